//! Store: sea-orm access to the database (SQLite or PostgreSQL).
//!
//! [`Store::apply_batch`] is the heart of ingest: in one transaction it locks
//! the batch's users, loads their state, runs the pure planner and writes the
//! plan together with its key-change events (the outbox).

pub(crate) mod backoff;
mod bulk;
mod bulk_rooms;
pub(crate) mod fetched;
pub(crate) mod job_start;
mod load;
mod one_of;
pub(crate) mod outbox;
pub mod query;
pub mod revalidate;
mod room_writes;
pub mod rooms;
mod rows;
mod sharing;
mod write;

pub use job_start::{JobStart, JobWait};

use std::collections::BTreeSet;
use std::time::Duration;

use migration::MigratorTrait;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, DbBackend,
    DbErr, EntityTrait, SqliteTransactionMode, TransactionOptions, TransactionTrait,
};

use tokio::sync::oneshot;

use crate::decide::{Plan, RoomSnapshot, plan_batch};
use crate::input::{InputMessage, Tracking};
use outbox::OutboxBatch;
use ruma::{OwnedServerName, OwnedUserId, RoomId, UserId};

/// Whether a failed connection is one that waiting cannot mend: TLS
/// refused (a certificate that does not verify, or a server without TLS when
/// `sslmode` requires it), a URL or setting the driver refuses, or the server
/// refusing who we are (SQLSTATE class 28: a wrong password, no `pg_hba.conf`
/// entry). A server still starting up (57P03) or not listening yet is not.
fn refused(error: &DbErr) -> bool {
    use sea_orm::sqlx::Error;
    let DbErr::Conn(sea_orm::RuntimeErr::SqlxError(error)) = error else {
        return false;
    };
    match &**error {
        Error::Tls(_) | Error::Configuration(_) => true,
        // A handshake the TLS layer refused comes through the socket.
        Error::Io(e) => e
            .get_ref()
            .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some()),
        Error::Database(e) => e.code().is_some_and(|code| code.starts_with("28")),
        _ => false,
    }
}

/// Whether a PostgreSQL URL sets `sslmode` (sqlx also reads `ssl-mode`).
fn names_ssl_mode(url: &str) -> bool {
    url.split_once('?').is_some_and(|(_, query)| {
        query
            .split('&')
            .filter_map(|pair| pair.split('=').next())
            .any(|key| key == "sslmode" || key == "ssl-mode")
    })
}

/// The wall clock in Unix milliseconds, as every stored time is kept.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// How long a SQLite writer waits for another writer before failing.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// What a committed batch did.
#[derive(Debug)]
pub struct Applied {
    /// The plan that was written.
    pub plan: Plan,
    /// Its events as recorded in the outbox (None: the plan had none).
    pub outbox: Option<OutboxBatch>,
}

/// Where a batch stands between the batch before it and the one after it
/// (see [`Store::apply_batch_in_turn`]). The default stands alone.
#[derive(Debug, Default)]
pub struct Turn {
    /// Resolves once the previous batch holds its user locks (or gave up).
    pub previous_locked: Option<oneshot::Receiver<()>>,
    /// Resolves with `true` once the previous batch committed; an error or
    /// `false` means it did not.
    pub previous_committed: Option<oneshot::Receiver<bool>>,
    /// Told once this batch holds its user locks.
    pub locked: Option<oneshot::Sender<()>>,
    /// Told once this batch committed (dropped unsent when it did not).
    pub committed: Option<oneshot::Sender<bool>>,
}

/// What the next batch waits on, handed from each batch's turn to the next.
#[derive(Debug)]
pub struct Baton {
    locked: oneshot::Receiver<()>,
    committed: oneshot::Receiver<bool>,
}

impl Turn {
    /// The turn of a batch that follows the one that handed over `previous`
    /// (None: nothing to follow), and the baton for the batch after it.
    pub fn after(previous: Option<Baton>) -> (Turn, Baton) {
        let (locked_tx, locked) = oneshot::channel();
        let (committed_tx, committed) = oneshot::channel();
        let (previous_locked, previous_committed) = match previous {
            Some(baton) => (Some(baton.locked), Some(baton.committed)),
            None => (None, None),
        };
        let turn = Turn {
            previous_locked,
            previous_committed,
            locked: Some(locked_tx),
            committed: Some(committed_tx),
        };
        (turn, Baton { locked, committed })
    }

    /// For a batch with nothing to write: passes the previous batch's
    /// progress on to the next one, so the next does not roll back for it.
    pub async fn pass(self) {
        if let Some(previous_locked) = self.previous_locked {
            let _ = previous_locked.await;
        }
        if let Some(locked) = self.locked {
            let _ = locked.send(());
        }
        let committed = match self.previous_committed {
            Some(previous) => previous.await == Ok(true),
            None => true,
        };
        if committed && let Some(tx) = self.committed {
            let _ = tx.send(true);
        }
    }
}

/// How the database's schema compares with this binary's migrations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Schema {
    /// Every migration this binary knows is applied, and no other.
    Current,
    /// Migrations this binary knows are not applied yet (`migrate` applies them).
    Behind {
        /// How many.
        pending: usize,
    },
    /// Migrations this binary does not know are applied (a newer binary ran
    /// `migrate`).
    Ahead {
        /// Their names.
        unknown: Vec<String>,
    },
}

/// The lock keys of a batch, sorted and without repeats: the users and
/// rooms its messages name, and `linked` (users that keys it names stand for).
fn lock_keys(messages: &[InputMessage], linked: &BTreeSet<OwnedUserId>) -> Vec<String> {
    let mut keys: Vec<String> = messages
        .iter()
        .filter_map(|m| m.user_id().map(UserId::as_str))
        .chain(
            messages
                .iter()
                .filter_map(|m| m.room_id().map(RoomId::as_str)),
        )
        .chain(linked.iter().map(|u| u.as_str()))
        .map(str::to_owned)
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// Handle to the database.
#[derive(Clone, Debug)]
pub struct Store {
    db: DatabaseConnection,
    /// Who is tracked: with rooms deciding (SPEC §5.5), batches keep room
    /// state and users sharing no room are not tracked.
    tracking: Tracking,
}

/// A pooled connection idle this long is pinged before it is used.
const IDLE_BEFORE_PING: Duration = Duration::from_secs(10);

/// The connections of the pool on PostgreSQL.
pub const POSTGRES_CONNECTIONS: usize = 8;

impl Store {
    /// Connects to `url` (`sqlite://…` or `postgres://…`) once.
    pub async fn connect(url: &str) -> Result<Store, DbErr> {
        let mut options = ConnectOptions::new(url.to_owned());
        options
            .sqlx_logging(false)
            .connect_timeout(Duration::from_secs(5))
            .acquire_timeout(Duration::from_secs(30))
            // sqlx pings a connection on every acquire by default: a round
            // trip to the database before each statement (measured: a
            // quarter of the fetch fan-out's database time). Only one idle
            // long enough to have gone stale is pinged; a connection that
            // broke under use fails its statement, which the callers
            // retry, and the pool replaces it.
            .test_before_acquire_if_idle_for(IDLE_BEFORE_PING);
        if url.starts_with("sqlite:") {
            // One writer at a time anyway; WAL lets readers (readyz, RPC) in.
            options.max_connections(1).map_sqlx_sqlite_opts(|o| {
                o.journal_mode(sea_orm::sqlx::sqlite::SqliteJournalMode::Wal)
                    .synchronous(sea_orm::sqlx::sqlite::SqliteSynchronous::Normal)
                    .busy_timeout(SQLITE_BUSY_TIMEOUT)
            });
        } else {
            options.max_connections(POSTGRES_CONNECTIONS as u32);
            if !names_ssl_mode(url) {
                // TLS only when asked for: libpq's default (`prefer`) would
                // encrypt whenever the server offers it, and sqlx 0.9 sends
                // TLS without TCP_NODELAY, so a statement that spans two TLS
                // records waits for a delayed ACK (40 ms). Ingest measured
                // 3.7 times slower (docs/operations.md "Secured PostgreSQL").
                options.map_sqlx_postgres_opts(|o| {
                    o.ssl_mode(sea_orm::sqlx::postgres::PgSslMode::Disable)
                });
            }
        }
        Ok(Store {
            db: Database::connect(options).await?,
            tracking: Tracking::Everyone,
        })
    }

    /// This store deciding who is tracked by `tracking`.
    pub fn with_tracking(mut self, tracking: Tracking) -> Store {
        self.tracking = tracking;
        self
    }

    /// Whether rooms decide who is tracked (membership on).
    pub fn membership(&self) -> bool {
        self.tracking.by_rooms()
    }

    /// Our server, when rooms decide who is tracked.
    fn rooms_own_server(&self) -> Option<&OwnedServerName> {
        self.tracking.rooms().map(|rules| &rules.own_server)
    }

    /// Connects, retrying until `wait` has passed; a refusal that waiting
    /// cannot mend (TLS, the URL, credentials) is returned at once.
    pub async fn connect_within(url: &str, wait: Duration) -> Result<Store, DbErr> {
        crate::startup::retry_within_unless(wait, || Store::connect(url), refused).await
    }

    /// Applies pending migrations.
    pub async fn migrate(&self) -> Result<(), DbErr> {
        migration::Migrator::up(&self.db, None).await
    }

    /// How the database's schema compares with this binary's migrations,
    /// read without changing anything (no table is created).
    pub async fn schema(&self) -> Result<Schema, DbErr> {
        use migration::seaql_migrations;
        let known: Vec<String> = migration::Migrator::migrations()
            .iter()
            .map(|m| m.name().to_owned())
            .collect();
        let manager = migration::SchemaManager::new(&self.db);
        let applied: BTreeSet<String> = if manager.has_table("seaql_migrations").await? {
            seaql_migrations::Entity::find()
                .all(&self.db)
                .await?
                .into_iter()
                .map(|row| row.version)
                .collect()
        } else {
            BTreeSet::new()
        };
        let unknown: Vec<String> = applied
            .iter()
            .filter(|name| !known.contains(name))
            .cloned()
            .collect();
        if !unknown.is_empty() {
            return Ok(Schema::Ahead { unknown });
        }
        let pending = known.iter().filter(|name| !applied.contains(*name)).count();
        Ok(match pending {
            0 => Schema::Current,
            pending => Schema::Behind { pending },
        })
    }

    /// The underlying connection (for tests and admin commands).
    pub fn connection(&self) -> &DatabaseConnection {
        &self.db
    }

    /// Whether the database answers.
    pub async fn ping(&self) -> bool {
        self.db.ping().await.is_ok()
    }

    /// Plans and writes one batch in a single transaction. When this returns,
    /// the plan's events are committed in the outbox; they are also handed
    /// back so they can be published without reading them again.
    pub async fn apply_batch(
        &self,
        messages: &[InputMessage],
        now_ms: i64,
    ) -> Result<Applied, DbErr> {
        let applied = self
            .apply_batch_in_turn(messages, now_ms, Turn::default())
            .await?;
        applied.ok_or_else(|| DbErr::Custom("no predecessor, yet overtaken".into()))
    }

    /// [`Store::apply_batch`] for a batch that overlaps the one before it.
    ///
    /// It takes its user locks only after the previous batch holds its own,
    /// so a user shared by both is applied in order; and it commits only if
    /// the previous batch committed. Ok(None): the previous batch failed and
    /// this one was rolled back, to be tried again once that one is done.
    pub async fn apply_batch_in_turn(
        &self,
        messages: &[InputMessage],
        now_ms: i64,
        turn: Turn,
    ) -> Result<Option<Applied>, DbErr> {
        // Wait before taking a connection: SQLite has one, and holding it
        // while the previous batch waits for it would deadlock.
        if let Some(previous_locked) = turn.previous_locked {
            // An error means the previous batch gave up: nothing to wait for.
            let _ = previous_locked.await;
        }
        let (txn, rooms, keys) = self.lock_batch(messages).await?;
        if let Some(locked) = turn.locked {
            let _ = locked.send(());
        }
        let users: Vec<&str> = keys
            .iter()
            .map(String::as_str)
            .filter(|k| k.starts_with('@'))
            .collect();
        let mut snapshot = load::snapshot(&txn, messages, &users).await?;
        if let Some(mut rooms) = rooms {
            rooms::load_shared(&txn, &mut rooms, &users).await?;
            snapshot.rooms = Some(rooms);
        }
        let plan = plan_batch(snapshot, messages, now_ms);
        if let Some(own) = self.rooms_own_server() {
            room_writes::write(&txn, &plan.rooms, own).await?;
        }
        let outbox = write::plan(&txn, &plan, now_ms).await?;
        if let Some(previous_committed) = turn.previous_committed
            && previous_committed.await != Ok(true)
        {
            txn.rollback().await?;
            return Ok(None);
        }
        txn.commit().await?;
        if let Some(committed) = turn.committed {
            let _ = committed.send(true);
        }
        Ok(Some(Applied { plan, outbox }))
    }

    /// Begins a batch's transaction and takes every lock it needs in one
    /// sorted round (docs/design.md, "One lock order"): the users the
    /// messages name, their rooms (room ids and user ids never collide: `!`
    /// and `@`), and the users that stored links of the keys they name stand
    /// for, read before locking. A link stored meanwhile for a user not
    /// locked (rare: only a batch holding the room's lock writes its links)
    /// means a new round with that user. Returns the transaction, the room
    /// state when rooms decide, and the keys locked, sorted.
    async fn lock_batch(
        &self,
        messages: &[InputMessage],
    ) -> Result<(DatabaseTransaction, Option<RoomSnapshot>, Vec<String>), DbErr> {
        let mut linked_before: BTreeSet<OwnedUserId> = BTreeSet::new();
        loop {
            let txn = self.begin_write().await?;
            if self.membership() {
                linked_before.extend(rooms::linked_users(&txn, messages).await?);
            }
            let keys = lock_keys(messages, &linked_before);
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            lock_users(&txn, &refs).await?;
            let Some(own) = self.rooms_own_server() else {
                return Ok((txn, None, keys));
            };
            let (rooms, linked) = rooms::load_rooms(&txn, own, messages).await?;
            let locked = |u: &OwnedUserId| {
                keys.binary_search_by(|k| k.as_str().cmp(u.as_str()))
                    .is_ok()
            };
            if linked.iter().all(locked) {
                return Ok((txn, Some(rooms), keys));
            }
            linked_before.extend(linked);
            txn.rollback().await?;
        }
    }

    /// Begins a transaction that writes. On SQLite it takes the write lock
    /// up front, so two writers never deadlock upgrading a read lock.
    async fn begin_write(&self) -> Result<sea_orm::DatabaseTransaction, DbErr> {
        self.db
            .begin_with_options(TransactionOptions {
                sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                ..Default::default()
            })
            .await
    }

    /// A random id created once per database: it prefixes every `Nats-Msg-Id`
    /// so ids stay unique even if the database is recreated.
    pub async fn instance_id(&self) -> Result<String, DbErr> {
        use entity::service_meta;
        use sea_orm::{ActiveValue::Set, sea_query::OnConflict};
        const NAME: &str = "instance_id";
        service_meta::Entity::insert(service_meta::ActiveModel {
            name: Set(NAME.to_owned()),
            value: Set(uuid::Uuid::new_v4().simple().to_string()),
        })
        .on_conflict(
            OnConflict::column(service_meta::Column::Name)
                .do_nothing()
                .to_owned(),
        )
        .exec_without_returning(&self.db)
        .await?;
        service_meta::Entity::find_by_id(NAME.to_owned())
            .one(&self.db)
            .await?
            .map(|m| m.value)
            .ok_or_else(|| DbErr::RecordNotFound("service_meta instance_id".into()))
    }
}

/// Serialises writers per user across replicas (SPEC §5.1.2). On PostgreSQL:
/// transaction-scoped advisory locks, taken in hash order so two batches never
/// deadlock. SQLite's IMMEDIATE transaction already excludes every other writer.
async fn lock_users<C: ConnectionTrait>(txn: &C, users: &[&str]) -> Result<(), DbErr> {
    if txn.get_database_backend() != DbBackend::Postgres || users.is_empty() {
        return Ok(());
    }
    bulk::lock_users(txn, users).await
}

#[cfg(test)]
mod tests {
    use super::names_ssl_mode;

    #[test]
    fn finds_sslmode_in_the_query_only() {
        for (url, named) in [
            ("postgres://u@db/dlu", false),
            ("postgres://u@db/dlu?sslmode=require", true),
            (
                "postgres://u@db/dlu?application_name=x&sslmode=disable",
                true,
            ),
            ("postgres://u@db/dlu?ssl-mode=verify-full", true),
            ("postgres://u@db/dlu?sslrootcert=/ca.pem", false),
            ("postgres://u@db/sslmode", false),
            ("postgres://u@db/dlu?xsslmode=require", false),
        ] {
            assert_eq!(names_ssl_mode(url), named, "{url}");
        }
    }
}
