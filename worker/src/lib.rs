//! The tch trainer: started by the agent, it follows its job's generations through the
//! tch-free runtime (`ductile_runtime`: the agent's environment, generations, join and fault
//! records, reports) and trains between re-formations ([`train`]); jobs without a
//! `[training]` section only follow their generations (`ductile_runtime::follow_generations`).
//!
//! A worker that cannot run on its slot (its GPU is not there, NCCL cannot load) exits with
//! [`ductile_runtime::EXIT_UNUSABLE`] and one line on stderr saying what is missing; the agent
//! reports that line with the exit and does not restart it.

pub mod data;
pub mod device;
pub mod faults;
pub mod hf;
pub mod model;
pub mod nccl;
pub mod optim;
pub mod synth;
pub mod tokenize;
pub mod train;

/// libtorch's random generator is global to the process: unit tests that seed it take turns.
#[cfg(test)]
pub(crate) static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());
