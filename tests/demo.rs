//! The README's demo shows key changes flowing.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_key_changes() {
    let mut out = Vec::new();
    device_list_updater::testkit::demo::run(&mut out).await;
    let text = String::from_utf8(out).unwrap();
    for needle in [
        "key_change.device → @alice:remote.example PHONE \"Alice's phone\"",
        "key_change.device → @alice:remote.example LAPTOP \"Alice's laptop\"",
        "key_change.device → @alice:remote.example PHONE \"Alice's new phone\"",
        "key_change.device → @alice:remote.example LAPTOP null (deleted)",
        "requests to remote.example in all: 1",
        "device PHONE: \"Alice's new phone\"",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rooms_demo_shows_join_fetch_leave_untrack() {
    let mut out = Vec::new();
    device_list_updater::testkit::demo::rooms(&mut out).await;
    let text = String::from_utf8(out).unwrap();
    for needle in [
        "key_change.device → @bob:remote.example PHONE \"Bob's phone\"",
        "tracked: true, shared_rooms: 1, requests to remote.example: 1",
        "key_change.device → @bob:remote.example PHONE \"Bob's new phone\"",
        "tracked: false, shared_rooms: 0, devices: {}",
        "tracked: false, key changes in all: 2, requests to remote.example in all: 1",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
}
