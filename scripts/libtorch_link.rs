// Included by the build scripts of crates whose binaries or tests link libtorch (through tch).
// torch-sys's rpath does not reach the final binaries: add one to $LIBTORCH/lib so they run
// without LD_LIBRARY_PATH, and keep libtorch.so linked even where no symbol of it is used
// (--no-as-needed), so that against a full CUDA libtorch the CUDA backend loads.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(lib) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}/lib");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch,--as-needed");
    }
}
