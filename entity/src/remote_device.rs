//! Remote devices as last received, including tombstones of deleted ones.

use sea_orm::entity::prelude::*;

/// One device of a remote user.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "remote_device")]
pub struct Model {
    /// Owner of the device.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub user_id: String,
    /// The device id.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub device_id: String,
    /// `device_display_name` as received, if any.
    #[sea_orm(column_type = "Text", nullable)]
    pub display_name: Option<String>,
    /// The device-keys object exactly as the remote sent it (NULL when absent or deleted).
    #[sea_orm(column_type = "Text", nullable)]
    pub keys_json: Option<String>,
    /// The stream id of the update (or fetch) that last wrote this row.
    pub stream_id: i64,
    /// A tombstone: the device was deleted at `stream_id`.
    pub deleted: bool,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
