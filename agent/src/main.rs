use clap::Parser;
use ductile_agent::config::{Cli, Config};

#[tokio::main]
async fn main() {
    // reqwest is built without a default TLS provider (ring builds fast): install ring's
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    let check = cli.check;
    let cfg = match Config::load(cli) {
        Ok(c) => c,
        Err(e) if check => {
            print!("FAIL config: {e:#}\nductile-agent: the configuration does not load; nothing else was checked\n");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("ductile-agent: {e:#}");
            std::process::exit(2);
        }
    };
    if check {
        let report = ductile_agent::check::run(&cfg).await;
        print!("{}", report.render(&format!("node {}", cfg.node)));
        std::process::exit(if report.passed() { 0 } else { 1 });
    }
    ductile_cluster::service::init_logging(cfg.log_format);
    let shutdown = ductile_cluster::service::shutdown_on_signals();
    // SIGHUP (systemctl reload): the configuration read again; its policy taken without a drain
    let reload_rx = ductile_cluster::service::reload_on_sighup(|| Config::load(Cli::parse()));
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
    if let Err(e) =
        ductile_agent::Agent::run_with_reload(cfg, backend, shutdown, Some(reload_rx)).await
    {
        eprintln!("ductile-agent: {e:#}");
        std::process::exit(1);
    }
}
