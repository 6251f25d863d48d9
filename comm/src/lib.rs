//! Communicators between the workers of one generation. Invariant: only this crate moves bytes
//! between workers (sockets, NCCL).
//!
//! Forming a communicator starts with the per-generation rendezvous in [`rendezvous`]: each
//! rank publishes what its peers need (a listen address, an NCCL unique id) under the
//! generation's prefix in etcd, and waits, bounded, for the rest.

pub mod rendezvous;

pub use rendezvous::{CommError, Rendezvous};
