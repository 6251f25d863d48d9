// Included by the build scripts of crates whose binaries or tests link libtorch (through tch).
// torch-sys's rpath does not reach the final binaries: add one so they run without
// LD_LIBRARY_PATH, and keep libtorch.so linked even where no symbol of it is used
// (--no-as-needed), so that against a full CUDA libtorch the CUDA backend loads.
// The rpath is $LIBTORCH/lib (this machine's libtorch: builds and tests here), unless
// DUCTILE_RPATH names another: scripts/package.sh gives '$ORIGIN/../lib/ductile/libtorch/lib',
// so that a packaged binary carries no path of the machine it was built on (the agent gives
// the workers the node's libtorch: its `libtorch` or `torch_python` setting).
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=DUCTILE_RPATH");
    let rpath = match std::env::var("DUCTILE_RPATH") {
        Ok(r) => Some(r),
        Err(_) => std::env::var("LIBTORCH").ok().map(|l| format!("{l}/lib")),
    };
    if let Some(r) = rpath.filter(|r| !r.is_empty()) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{r}");
    }
    if std::env::var("LIBTORCH").is_ok() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch,--as-needed");
    }
}
