include!("../scripts/libtorch_link.rs");
