//! The generated code in `proto/gen/` is committed, so that neither users nor
//! CI need `protoc`. This test regenerates it with the vendored `protoc` and
//! fails if the committed copy is stale. Run with `TONIC_RETRY_BLESS=1` to
//! rewrite the committed copy.

use std::path::{Path, PathBuf};

#[test]
fn generated_code_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let committed = root.join("proto/gen/library.v1.rs");
    let out: PathBuf =
        std::env::temp_dir().join(format!("tonic-retry-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&out).expect("temporary output folder");

    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc for this platform");
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure()
        .out_dir(&out)
        .emit_rerun_if_changed(false)
        .compile_with_config(
            config,
            &[root.join("proto/library.proto")],
            &[root.join("proto")],
        )
        .expect("code generation");

    let fresh = std::fs::read_to_string(out.join("library.v1.rs")).expect("generated file");
    let _ = std::fs::remove_dir_all(&out);
    if std::env::var_os("TONIC_RETRY_BLESS").is_some() {
        std::fs::write(&committed, &fresh).expect("write the committed copy");
        return;
    }
    let current = std::fs::read_to_string(&committed).unwrap_or_default();
    assert!(
        current == fresh,
        "proto/gen/library.v1.rs is stale: run `TONIC_RETRY_BLESS=1 cargo test --test published codegen` and commit the result"
    );
}
