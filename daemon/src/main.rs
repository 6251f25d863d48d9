use clap::Parser;
use ductile_daemon::config::{Cli, Config};

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let cfg = match Config::load(cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ductiled: {e:#}");
            std::process::exit(2);
        }
    };
    ductile_cluster::service::init_logging(cfg.log_format);
    let cancel = ductile_cluster::service::shutdown_on_signals();
    let backend = match ductile_cluster::connect_etcd_with(&cfg.etcd, cfg.etcd_wait).await {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(
                "cannot start: {}",
                ductile_cluster::service::error_chain(&e)
            );
            eprintln!(
                "ductiled: cannot reach etcd at {}: {}",
                cfg.etcd.endpoints,
                ductile_cluster::service::error_chain(&e)
            );
            std::process::exit(1);
        }
    };
    if let Err(e) = ductile_daemon::run(cfg, backend, cancel).await {
        eprintln!("ductiled: {e:#}");
        std::process::exit(1);
    }
}
