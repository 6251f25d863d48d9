use std::time::Duration;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    ductile_cluster::service::init_logging(ductile_cluster::service::LogFormat::Plain);
    let env = match ductile_worker::WorkerEnv::from_env() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("ductile-worker: {e:#}");
            std::process::exit(2);
        }
    };
    let cancel = ductile_cluster::service::shutdown_on_signals();
    let backend = match ductile_cluster::connect_etcd(&env.etcd, Duration::from_secs(30)).await {
        Ok(b) => b,
        Err(e) => {
            eprintln!(
                "ductile-worker: cannot reach etcd at {}: {}",
                env.etcd,
                ductile_cluster::service::error_chain(&e)
            );
            std::process::exit(1);
        }
    };
    match ductile_worker::follow_generations(env, backend, cancel).await {
        Ok(()) => std::process::exit(ductile_worker::EXIT_FENCED),
        Err(e) => {
            eprintln!("ductile-worker: {e:#}");
            std::process::exit(1);
        }
    }
}
