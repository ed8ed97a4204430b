//! Any `/user/devices` answer body: parsed without panicking, and a parsed
//! answer plans (device ownership and cross-signing checks included).
#![no_main]

use device_list_updater::decide::fetched::{StoredUser, plan_fetch};
use device_list_updater::fetch::answer::parse;
use libfuzzer_sys::fuzz_target;
use ruma::UserId;

fuzz_target!(|body: &[u8]| {
    let Ok((list, _unreadable)) = parse(body) else {
        return;
    };
    let requested = <&UserId>::try_from(list.user_id.as_str())
        .unwrap_or_else(|_| <&UserId>::try_from("@alice:remote.example").expect("valid"));
    let _ = plan_fetch(requested, &StoredUser::default(), None, &list, 1000);
});
