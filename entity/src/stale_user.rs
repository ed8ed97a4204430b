//! Users whose device list must be fetched again. A row's presence is the flag.

use sea_orm::entity::prelude::*;

/// One stale user.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "stale_user")]
pub struct Model {
    /// The stale user.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub user_id: String,
    /// The user's server, so one fetch job can serve all its stale users.
    #[sea_orm(column_type = "Text")]
    pub server_name: String,
    /// When the user was first marked stale (Unix milliseconds).
    pub marked_at_ms: i64,
    /// JSON array of the stream ids of the updates that made the user stale;
    /// they count as known once a fetch succeeds.
    #[sea_orm(column_type = "Text")]
    pub trigger_stream_ids: String,
    /// Why the last fetch of this user failed (None: not tried yet).
    #[sea_orm(column_type = "Text", nullable)]
    pub last_error: Option<String>,
    /// This user's own failed fetches in a row (SPEC §5.2: an answer that is
    /// the user's fault backs off the user alone).
    pub failures: i32,
    /// When this user may be fetched again (Unix milliseconds; 0: now).
    pub next_attempt_ms: i64,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
