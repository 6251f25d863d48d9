//! The worker's device: `DUCTILE_DEVICE` (`cpu` or `cuda:N`), checked at start so that a slot
//! whose GPU is not there fails at once with a message naming what is missing, and the
//! deterministic settings of PyTorch's global context.

use tch::Device;

use ductile_runtime::Unusable;

/// `cpu` or `cuda:N` (`cuda` is `cuda:0`).
pub fn parse(s: &str) -> Result<Device, Unusable> {
    match s.trim() {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => other
            .strip_prefix("cuda:")
            .and_then(|i| i.parse::<usize>().ok())
            .map(Device::Cuda)
            .ok_or_else(|| Unusable(format!("DUCTILE_DEVICE={other:?} is not cpu or cuda:N"))),
    }
}

/// That `device` can be used here; the error names what is missing.
pub fn check(device: Device) -> Result<(), Unusable> {
    let Device::Cuda(i) = device else {
        return Ok(());
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "(unset)".into());
    if !tch::Cuda::is_available() {
        return Err(Unusable(format!(
            "this slot asks for GPU cuda:{i} (CUDA_VISIBLE_DEVICES={visible}), but CUDA is not \
             usable here: {}",
            cuda_missing()
        )));
    }
    let n = tch::Cuda::device_count();
    if i as i64 >= n {
        return Err(Unusable(format!(
            "this slot asks for GPU cuda:{i} (CUDA_VISIBLE_DEVICES={visible}), but only {n} \
             CUDA device(s) are visible"
        )));
    }
    Ok(())
}

/// Why CUDA is not usable: no driver, or a libtorch without CUDA.
fn cuda_missing() -> String {
    let has = |name: &str| {
        let c = std::ffi::CString::new(name).unwrap();
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        let h = if h.is_null() {
            unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY) }
        } else {
            h
        };
        !h.is_null()
    };
    if !has("libcuda.so.1") {
        "no NVIDIA driver (libcuda.so.1 is not on this machine)".into()
    } else if !has("libtorch_cuda.so") {
        "the libtorch on the library path has no CUDA (libtorch_cuda.so not found: point \
         LD_LIBRARY_PATH at a CUDA PyTorch's torch/lib)"
            .into()
    } else {
        "the driver reports no usable device".into()
    }
}

extern "C" {
    #[link_name = "_ZN2at13globalContextEv"]
    fn at_global_context() -> *mut std::ffi::c_void;
    #[link_name = "_ZN2at7Context26setDeterministicAlgorithmsEbb"]
    fn at_set_deterministic_algorithms(ctx: *mut std::ffi::c_void, on: bool, warn_only: bool);
    #[link_name = "_ZN2at7Context21setDeterministicCuDNNEb"]
    fn at_set_deterministic_cudnn(ctx: *mut std::ffi::c_void, on: bool);
    #[link_name = "_ZN2at7Context17setBenchmarkCuDNNEb"]
    fn at_set_benchmark_cudnn(ctx: *mut std::ffi::c_void, on: bool);
}

/// Deterministic kernels (`torch.use_deterministic_algorithms(True)`, cuDNN deterministic and
/// not benchmarking). cuBLAS also needs `CUBLAS_WORKSPACE_CONFIG`, which must be in the
/// environment before its first handle: see [`prepare_env`].
pub fn set_deterministic(on: bool) {
    unsafe {
        let ctx = at_global_context();
        at_set_deterministic_algorithms(ctx, on, false);
        at_set_deterministic_cudnn(ctx, on);
        at_set_benchmark_cudnn(ctx, false);
    }
}

/// Before cuBLAS's first handle (the first matmul): the cuBLAS workspace setting that
/// deterministic kernels need (PyTorch's documented `:4096:8`), for deterministic CUDA jobs
/// only (it restricts cuBLAS's choice of algorithms), unless the operator set one.
pub fn prepare_env(device: &str, deterministic: bool) {
    if deterministic
        && device.starts_with("cuda")
        && std::env::var_os("CUBLAS_WORKSPACE_CONFIG").is_none()
    {
        // called once, before the training thread starts and before any tch call that
        // could read the environment
        std::env::set_var("CUBLAS_WORKSPACE_CONFIG", ":4096:8");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_and_refuses_others() {
        assert_eq!(parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(parse("cuda:1").unwrap(), Device::Cuda(1));
        assert_eq!(parse("cuda").unwrap(), Device::Cuda(0));
        assert!(parse("tpu:0").unwrap_err().0.contains("tpu:0"));
    }

    #[test]
    fn a_missing_gpu_is_named() {
        if tch::Cuda::is_available() {
            return; // a GPU machine: nothing missing to name
        }
        let e = check(Device::Cuda(0)).unwrap_err().0;
        assert!(e.contains("cuda:0") && e.contains("not usable"), "{e}");
        assert!(check(Device::Cpu).is_ok());
        // deterministic settings apply on CPU libtorch too (and do not crash)
        set_deterministic(true);
        set_deterministic(false);
    }
}
