//! MSC4430 member keys' links to their users, per room (SPEC §5.6).

use sea_orm::entity::prelude::*;

/// One key's link in one room.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "member_key_link")]
pub struct Model {
    /// The room the key belongs to.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub room_id: String,
    /// The member key.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub member_key: String,
    /// The first user the key was linked to (kept after an erasure, so a
    /// later link to someone else is still a conflict).
    #[sea_orm(column_type = "Text", nullable)]
    pub user_id: Option<String>,
    /// The link was removed (`user_id: null` after a known link).
    pub erased: bool,
    /// The homeserver's last check of the link succeeded.
    pub verified: bool,
    /// The `stream_ordering` of the link message applied last.
    pub stream_ordering: i64,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
