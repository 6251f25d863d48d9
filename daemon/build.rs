// TorchFT's lighthouse protocol (proto/torchft.proto): server and client (the client is what
// a replica that is not the leader uses nowhere; tests and benches use it to speak to ductiled
// as TorchFT's own client does).
fn main() {
    println!("cargo:rerun-if-changed=proto/torchft.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/torchft.proto"], &["proto"])
        .unwrap_or_else(|e| panic!("compiling proto/torchft.proto (needs protoc: scripts/setup.sh installs protobuf-compiler): {e}"));
}
