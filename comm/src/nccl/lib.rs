//! Which NCCL: exactly the copy libtorch loaded.
//!
//! Two NCCL copies in one process corrupt each other's communicators (measured on an H100:
//! libtorch_cuda had mapped the `nvidia-nccl-cu13` wheel's `libnccl.so.2` 2.28.9, cudarc's
//! name-based loading found the system's `libnccl.so` 2.28.3, and every collective failed with
//! `corrupted comm object detected`). So NCCL is never looked up by name here:
//!
//! 1. `DUCTILE_NCCL_LIB=/path/libnccl.so.2` names the library; if another copy is already mapped
//!    in this process, that is refused with both paths.
//! 2. Else the `libnccl.so*` already mapped in the process (libtorch_cuda's dependency) is used.
//! 3. Else `libtorch_cuda.so` is loaded (a CUDA libtorch on the library path maps its NCCL), and
//!    step 2 is tried again; when no copy is mapped after that, the error says what is missing.
//!
//! The symbols are resolved from that one handle into a table of function pointers with
//! cudarc's types; cudarc's own NCCL loader (by name) is never called.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};

/// The NCCL entry points ductile uses, resolved from one library.
pub struct Nccl {
    pub path: String,
    pub version: i32,
    pub get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t,
    pub comm_init_rank_config: unsafe extern "C" fn(
        *mut ncclComm_t,
        c_int,
        ncclUniqueId,
        c_int,
        *mut ncclConfig_t,
    ) -> ncclResult_t,
    pub comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t,
    pub comm_abort: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    pub comm_destroy: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    /// `ncclCommShrink` (NCCL 2.27+); `None` where the library lacks it.
    pub comm_shrink: Option<
        unsafe extern "C" fn(
            ncclComm_t,
            *mut c_int,
            c_int,
            *mut ncclComm_t,
            *mut ncclConfig_t,
            c_int,
        ) -> ncclResult_t,
    >,
    pub all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub send: unsafe extern "C" fn(
        *const c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub recv: unsafe extern "C" fn(
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub get_error_string: unsafe extern "C" fn(ncclResult_t) -> *const c_char,
    /// `ncclGroupStart` / `ncclGroupEnd`: the sends and receives of one exchange go together.
    pub group_start: unsafe extern "C" fn() -> ncclResult_t,
    pub group_end: unsafe extern "C" fn() -> ncclResult_t,
}

/// The paths of every `libnccl.so*` mapped in this process, in load order.
pub fn mapped_copies() -> Vec<String> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        let out = &mut *(data as *mut Vec<String>);
        let name = (*info).dlpi_name;
        if !name.is_null() {
            let path = CStr::from_ptr(name).to_string_lossy().into_owned();
            let base = path.rsplit('/').next().unwrap_or("");
            if base.starts_with("libnccl.so") {
                out.push(path);
            }
        }
        0
    }
    let mut out: Vec<String> = Vec::new();
    unsafe { libc::dl_iterate_phdr(Some(each), &mut out as *mut Vec<String> as *mut c_void) };
    out
}

fn dlerror() -> String {
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// The same file, compared by device and inode (a symlink and its target are one copy).
fn same_file(a: &str, b: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => a == b,
    }
}

/// Decide which library to load, from what is mapped and what `DUCTILE_NCCL_LIB` says.
pub fn choose(mapped: &[String], named: Option<&str>) -> Result<String, String> {
    match (named, mapped.first()) {
        (Some(n), Some(m)) if !same_file(n, m) => Err(format!(
            "DUCTILE_NCCL_LIB names {n}, but this process already loaded NCCL from {m} \
             (libtorch's copy): two NCCL copies in one process corrupt each other's \
             communicators; unset DUCTILE_NCCL_LIB or point it at {m}"
        )),
        (Some(n), _) => {
            if std::path::Path::new(n).exists() {
                Ok(n.to_string())
            } else {
                Err(format!("DUCTILE_NCCL_LIB names {n}, which does not exist"))
            }
        }
        (None, Some(m)) => Ok(m.clone()),
        (None, None) => Err(
            "no NCCL is loaded in this process: libtorch_cuda (which loads PyTorch's \
             libnccl.so.2) is not on the library path; point LD_LIBRARY_PATH at a CUDA \
             PyTorch's torch/lib, or set DUCTILE_NCCL_LIB to the libnccl.so.2 your libtorch uses"
                .into(),
        ),
    }
}

unsafe fn sym<T: Copy>(handle: *mut c_void, path: &str, name: &str) -> Result<T, String> {
    let c = CString::new(name).unwrap();
    let p = libc::dlsym(handle, c.as_ptr());
    if p.is_null() {
        return Err(format!("{path} has no symbol {name}"));
    }
    Ok(std::mem::transmute_copy::<*mut c_void, T>(&p))
}

fn load() -> Result<Nccl, String> {
    let named = std::env::var("DUCTILE_NCCL_LIB")
        .ok()
        .filter(|s| !s.is_empty());
    let mut mapped = mapped_copies();
    if mapped.is_empty() && named.is_none() {
        // a CPU shim libtorch.so does not pull libtorch_cuda in; a CUDA one on the path does
        let c = CString::new("libtorch_cuda.so").unwrap();
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !h.is_null() {
            mapped = mapped_copies();
        }
    }
    if mapped.len() > 1 && !mapped.iter().all(|m| same_file(m, &mapped[0])) {
        return Err(format!(
            "several NCCL copies are already loaded in this process ({}): they corrupt each \
             other's communicators",
            mapped.join(", ")
        ));
    }
    let path = choose(&mapped, named.as_deref())?;
    let c = CString::new(path.clone()).map_err(|e| e.to_string())?;
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        return Err(format!("cannot load NCCL from {path}: {}", dlerror()));
    }
    unsafe {
        let get_version: unsafe extern "C" fn(*mut c_int) -> ncclResult_t =
            sym(handle, &path, "ncclGetVersion")?;
        let mut version = 0;
        get_version(&mut version);
        Ok(Nccl {
            version,
            get_unique_id: sym(handle, &path, "ncclGetUniqueId")?,
            comm_init_rank_config: sym(handle, &path, "ncclCommInitRankConfig")?,
            comm_get_async_error: sym(handle, &path, "ncclCommGetAsyncError")?,
            comm_abort: sym(handle, &path, "ncclCommAbort")?,
            comm_destroy: sym(handle, &path, "ncclCommDestroy")?,
            comm_shrink: sym(handle, &path, "ncclCommShrink").ok(),
            all_reduce: sym(handle, &path, "ncclAllReduce")?,
            broadcast: sym(handle, &path, "ncclBroadcast")?,
            all_gather: sym(handle, &path, "ncclAllGather")?,
            reduce_scatter: sym(handle, &path, "ncclReduceScatter")?,
            send: sym(handle, &path, "ncclSend")?,
            recv: sym(handle, &path, "ncclRecv")?,
            get_error_string: sym(handle, &path, "ncclGetErrorString")?,
            group_start: sym(handle, &path, "ncclGroupStart")?,
            group_end: sym(handle, &path, "ncclGroupEnd")?,
            path,
        })
    }
}

/// The process's NCCL, loaded once; the error says what is missing or conflicting.
pub fn nccl() -> Result<&'static Nccl, String> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(|e| e.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chooses_the_mapped_copy_and_refuses_a_second_one() {
        let dir = std::env::temp_dir().join(format!("ductile-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (torch, system) = (dir.join("torch-libnccl.so.2"), dir.join("sys-libnccl.so.2"));
        std::fs::write(&torch, b"a").unwrap();
        std::fs::write(&system, b"b").unwrap();
        let link = dir.join("libnccl.so.2");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&torch, &link).unwrap();
        let (t, s, l) = (
            torch.to_str().unwrap(),
            system.to_str().unwrap(),
            link.to_str().unwrap(),
        );
        let mapped = vec![t.to_string()];
        assert_eq!(choose(&mapped, None).unwrap(), t);
        // naming the same copy (through a symlink) is fine; naming another is refused
        assert_eq!(choose(&mapped, Some(l)).unwrap(), l);
        let e = choose(&mapped, Some(s)).unwrap_err();
        assert!(
            e.contains(s) && e.contains(t) && e.contains("two NCCL copies"),
            "{e}"
        );
        // nothing mapped: a named file is used, a missing one or none is a clear error
        assert_eq!(choose(&[], Some(s)).unwrap(), s);
        let missing = dir.join("nope.so");
        assert!(choose(&[], Some(missing.to_str().unwrap()))
            .unwrap_err()
            .contains("does not exist"));
        assert!(choose(&[], None).unwrap_err().contains("LD_LIBRARY_PATH"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
