//! Per remote user stream state: the stream ids we know, for the prev_id rule.

use sea_orm::entity::prelude::*;

/// One remote user we track.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "remote_user")]
pub struct Model {
    /// The Matrix user id, e.g. `@alice:remote.example`.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub user_id: String,
    /// The user's server name (the part after the first `:`).
    #[sea_orm(column_type = "Text")]
    pub server_name: String,
    /// JSON array of the most recent stream ids known for the user, newest first.
    #[sea_orm(column_type = "Text")]
    pub known_stream_ids: String,
    /// The highest stream id ever recorded for the user.
    pub max_stream_id: i64,
    /// The stream position of the last fetched list (0: never fetched).
    /// Updates at or below it are already part of that list.
    pub fetched_stream_id: i64,
    /// When the list was last fetched (Unix ms; 0: never). A list older
    /// than `DLU_REVALIDATE_AFTER` is fetched again (SPEC §5.7).
    pub fetched_at_ms: i64,
}

/// No relations are declared: joins are written where they are needed.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
