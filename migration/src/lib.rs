//! Database migrations of device-list-updater.
//!
//! One set of migrations runs on both SQLite and PostgreSQL; every table is
//! described in `docs/storage.md`. Migrations are applied by `device-list-updater
//! migrate` and at the start of `device-list-updater run`; the `admin`
//! commands only compare the applied ones with this list.

pub use sea_orm_migration::prelude::*;
/// The table of applied migrations (read by `admin` to compare schemas).
pub use sea_orm_migration::seaql_migrations;

mod m20261130_000001_initial;
mod m20261201_000001_postgres_tuning;
mod m20261201_000002_fetched_stream_id;
mod m20261201_000003_fetch_backoff;
mod m20261202_000001_rooms;
mod m20261203_000001_room_sweep_index;
mod m20261203_000002_room_id_collation;
mod m20261204_000001_revalidation;

/// The list of migrations, oldest first.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261130_000001_initial::Migration),
            Box::new(m20261201_000001_postgres_tuning::Migration),
            Box::new(m20261201_000002_fetched_stream_id::Migration),
            Box::new(m20261201_000003_fetch_backoff::Migration),
            Box::new(m20261202_000001_rooms::Migration),
            Box::new(m20261203_000001_room_sweep_index::Migration),
            Box::new(m20261203_000002_room_id_collation::Migration),
            Box::new(m20261204_000001_revalidation::Migration),
        ]
    }
}
