//! Element types, raw views of tch tensors, and the reduction kernels. Reductions are
//! elementwise and in a fixed order, so the same inputs give the same bits everywhere.

use half::{bf16, f16};
use tch::{Device, Kind, Tensor};

use crate::error::{CommError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn of(kind: Kind, op: &'static str) -> Result<DType> {
        match kind {
            Kind::Float => Ok(DType::F32),
            Kind::Double => Ok(DType::F64),
            Kind::Half => Ok(DType::F16),
            Kind::BFloat16 => Ok(DType::BF16),
            other => Err(CommError::Invalid {
                op,
                reason: format!("unsupported dtype {other:?} (f32, f64, f16, bf16)"),
            }),
        }
    }
}

/// Check a tensor can be used in place by the CPU backend.
pub fn check_cpu(t: &Tensor, op: &'static str) -> Result<DType> {
    if t.device() != Device::Cpu {
        return Err(CommError::Invalid {
            op,
            reason: format!("the TCP backend needs CPU tensors, got {:?}", t.device()),
        });
    }
    if !t.is_contiguous() {
        return Err(CommError::Invalid {
            op,
            reason: "tensor must be contiguous".into(),
        });
    }
    DType::of(t.kind(), op)
}

/// The bytes of a contiguous CPU tensor.
///
/// # Safety
/// The tensor must be contiguous, on the CPU, and not accessed otherwise while the slice lives.
// tch tensors are handles with interior mutability: `&Tensor` is how tch itself hands out
// in-place access (`f_add_`, `copy_`), so the exclusive use is this function's contract.
#[allow(clippy::mut_from_ref)]
pub unsafe fn bytes_mut(t: &Tensor) -> &mut [u8] {
    let n = t.numel() * t.kind().elt_size_in_bytes();
    if n == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, n)
}

/// `dst += src`, elementwise. Both must hold whole elements; `dst` and `src` may be unaligned.
pub fn add_into(dtype: DType, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    macro_rules! lanes {
        ($t:ty, $n:expr, $add:expr) => {{
            for (d, s) in dst.chunks_exact_mut($n).zip(src.chunks_exact($n)) {
                let a = <$t>::from_le_bytes(d.try_into().unwrap());
                let b = <$t>::from_le_bytes(s.try_into().unwrap());
                let f: fn($t, $t) -> $t = $add;
                d.copy_from_slice(&f(a, b).to_le_bytes());
            }
        }};
    }
    match dtype {
        DType::F32 => {
            // aligned fast path (tensor data and our scratch are aligned)
            if (dst.as_ptr() as usize).is_multiple_of(4)
                && (src.as_ptr() as usize).is_multiple_of(4)
            {
                let d = unsafe {
                    std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut f32, dst.len() / 4)
                };
                let s = unsafe {
                    std::slice::from_raw_parts(src.as_ptr() as *const f32, src.len() / 4)
                };
                for (a, b) in d.iter_mut().zip(s) {
                    *a += *b;
                }
            } else {
                lanes!(f32, 4, |a, b| a + b)
            }
        }
        DType::F64 => {
            if (dst.as_ptr() as usize).is_multiple_of(8)
                && (src.as_ptr() as usize).is_multiple_of(8)
            {
                let d = unsafe {
                    std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut f64, dst.len() / 8)
                };
                let s = unsafe {
                    std::slice::from_raw_parts(src.as_ptr() as *const f64, src.len() / 8)
                };
                for (a, b) in d.iter_mut().zip(s) {
                    *a += *b;
                }
            } else {
                lanes!(f64, 8, |a, b| a + b)
            }
        }
        DType::F16 => lanes!(u16, 2, |a, b| f16::from_f32(
            f16::from_bits(a).to_f32() + f16::from_bits(b).to_f32()
        )
        .to_bits()),
        DType::BF16 => lanes!(u16, 2, |a, b| bf16::from_f32(
            bf16::from_bits(a).to_f32() + bf16::from_bits(b).to_f32()
        )
        .to_bits()),
    }
}

/// An 8-byte-aligned scratch buffer.
pub struct Scratch(Vec<u64>);

impl Scratch {
    pub fn new() -> Self {
        Scratch(Vec::new())
    }
    pub fn get(&mut self, bytes: usize) -> &mut [u8] {
        let words = bytes.div_ceil(8);
        if self.0.len() < words {
            self.0.resize(words, 0);
        }
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut u8, bytes) }
    }
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_every_dtype() {
        let mut a = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<u8>>();
        let b = [0.25f32, 4.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<u8>>();
        add_into(DType::F32, &mut a, &b);
        assert_eq!(f32::from_le_bytes(a[0..4].try_into().unwrap()), 1.75);
        let mut h = f16::from_f32(1.0).to_bits().to_le_bytes().to_vec();
        add_into(
            DType::F16,
            &mut h,
            &f16::from_f32(0.5).to_bits().to_le_bytes(),
        );
        assert_eq!(
            f16::from_bits(u16::from_le_bytes([h[0], h[1]])).to_f32(),
            1.5
        );
        let mut h = bf16::from_f32(2.0).to_bits().to_le_bytes().to_vec();
        add_into(
            DType::BF16,
            &mut h,
            &bf16::from_f32(3.0).to_bits().to_le_bytes(),
        );
        assert_eq!(
            bf16::from_bits(u16::from_le_bytes([h[0], h[1]])).to_f32(),
            5.0
        );
    }
}
