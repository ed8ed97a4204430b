//! `cargo run --example demo` (or `scripts/demo`): the whole pipeline on one
//! machine; see `device_list_updater::testkit::demo`.

#[tokio::main]
async fn main() {
    device_list_updater::testkit::demo::run(&mut std::io::stdout()).await;
}
