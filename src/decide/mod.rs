//! Decide: the pure rules that turn input into writes and events (SPEC §5.1,
//! §5.4, §5.5, §5.6, §5.7). Nothing here does I/O, so all of it is unit-tested in memory.

pub mod batch;
pub mod device;
pub mod fetched;
pub mod known_ids;
pub mod membership;
pub mod partitions;
pub mod plan;
pub mod revalidate;
pub mod rooms;
pub mod rules;

pub use batch::plan_batch;
pub use plan::{
    Outcome, Plan, RoomRow, RoomSnapshot, RoomUser, RoomWrites, Snapshot, StaleMark, UserState,
};
