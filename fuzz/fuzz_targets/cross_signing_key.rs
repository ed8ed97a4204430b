//! Any text as a cross-signing key object: the check answers, never panics.
#![no_main]

use device_list_updater::input::cross_signing::{KeyUsage, check};
use libfuzzer_sys::fuzz_target;
use ruma::UserId;

fuzz_target!(|data: &[u8]| {
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(user) = <&UserId>::try_from("@alice:remote.example") else {
        return;
    };
    for usage in [KeyUsage::Master, KeyUsage::SelfSigning] {
        let _ = check(raw, user, usage);
    }
});
