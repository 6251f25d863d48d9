use clap::Parser;
use ductile_daemon::config::{Cli, Config};

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let (check, check_host) = (cli.check, cli.check_host.clone());
    let cfg = match Config::load(cli) {
        Ok(c) => c,
        Err(e) if check => {
            print!("FAIL config: {e:#}\nductiled: the configuration does not load; nothing else was checked\n");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("ductiled: {e:#}");
            std::process::exit(2);
        }
    };
    if check {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let report = ductile_daemon::config::check(&cfg, &check_host).await;
        print!("{}", report.render(&format!("ductiled {}", cfg.id)));
        std::process::exit(if report.passed() { 0 } else { 1 });
    }
    ductile_cluster::service::init_logging(cfg.log_format);
    let cancel = ductile_cluster::service::shutdown_on_signals();
    // SIGHUP (systemctl reload): the configuration read again, its tokens taken at once
    let reload_rx = ductile_cluster::service::reload_on_sighup(|| Config::load(Cli::parse()));
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
    if let Err(e) = ductile_daemon::run_with_reload(cfg, backend, cancel, Some(reload_rx)).await {
        eprintln!("ductiled: {e:#}");
        std::process::exit(1);
    }
}
