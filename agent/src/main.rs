use clap::Parser;
use ductile_agent::config::{Cli, Config};

#[tokio::main]
async fn main() {
    // reqwest is built without a default TLS provider (ring builds fast): install ring's
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cfg = match Config::load(Cli::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ductile-agent: {e:#}");
            std::process::exit(2);
        }
    };
    ductile_cluster::service::init_logging(cfg.log_format);
    let shutdown = ductile_cluster::service::shutdown_on_signals();
    let backend = match ductile_cluster::connect_etcd_with(&cfg.etcd, cfg.etcd_wait).await {
        Ok(b) => b,
        Err(e) => {
            eprintln!(
                "ductile-agent: cannot reach etcd at {}: {}",
                cfg.etcd.endpoints,
                ductile_cluster::service::error_chain(&e)
            );
            std::process::exit(1);
        }
    };
    if let Err(e) = ductile_agent::Agent::run(cfg, backend, shutdown).await {
        eprintln!("ductile-agent: {e:#}");
        std::process::exit(1);
    }
}
