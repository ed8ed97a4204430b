//! Any bytes on an input subject, with or without an `origin` header: the
//! parser returns a verdict (never panics), and what it accepts plans.
#![no_main]

use device_list_updater::decide::{Snapshot, plan_batch};
use device_list_updater::input::{InputKind, Parsed, parse};
use libfuzzer_sys::fuzz_target;
use ruma::ServerName;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let kinds = InputKind::ALL;
    let kind = kinds[usize::from(selector) % kinds.len()];
    let origin = match usize::from(selector) / kinds.len() % 3 {
        0 => None,
        1 => Some("remote.example"),
        _ => Some("other.example"),
    };
    let Ok(own) = <&ServerName>::try_from("own.example") else {
        return;
    };
    if let Ok(Parsed::Accept(message)) = parse(kind, body, origin, own) {
        let plan = plan_batch(Snapshot::default(), &[message.clone(), message], 0);
        assert_eq!(plan.outcomes.len(), 2);
    }
});
