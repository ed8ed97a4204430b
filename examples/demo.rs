//! `cargo run --example demo` (or `scripts/demo`): the whole pipeline on one
//! machine; `scripts/demo rooms`: rooms deciding who is tracked. See
//! `device_list_updater::testkit::demo`.

#[tokio::main]
async fn main() {
    let mut out = std::io::stdout();
    match std::env::args().nth(1).as_deref() {
        None => device_list_updater::testkit::demo::run(&mut out).await,
        Some("rooms") => device_list_updater::testkit::demo::rooms(&mut out).await,
        Some(other) => {
            eprintln!("unknown demo {other:?}; try no argument, or `rooms`");
            std::process::exit(2);
        }
    }
}
