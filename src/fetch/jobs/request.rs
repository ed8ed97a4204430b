//! One request of a fetch job: who it is for (a stale user or a
//! revalidation), sending it, storing the answer, and what it came to.

use super::Fetcher;
use crate::decide::fetched::FetchRefusal;
use crate::fetch::federation::FetchFailure;
use crate::fetch::retry::{Blame, FailureKind, blame};
use crate::fetch::writer::Written;
use crate::store::backoff::DueUser;
use crate::store::fetched::FetchedUser;
use crate::store::revalidate::DueRevalidation;
use ruma::OwnedUserId;

/// Who a request of a job is for.
#[derive(Clone, Copy, Debug)]
pub(super) enum Asked<'a> {
    /// A stale user (real work).
    Stale(&'a DueUser),
    /// A revalidation (SPEC §5.7).
    Revalidation(&'a DueRevalidation),
}

impl Asked<'_> {
    pub(super) fn user(&self) -> &OwnedUserId {
        match self {
            Asked::Stale(due) => &due.user,
            Asked::Revalidation(due) => &due.user,
        }
    }

    pub(super) fn failures(&self) -> u32 {
        match self {
            Asked::Stale(due) => due.failures,
            Asked::Revalidation(due) => due.failures,
        }
    }
}

/// What a fetch that did not fail came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fetched {
    /// The list was stored; `changed`: it differed from what was stored.
    Stored {
        /// Devices or keys changed.
        changed: bool,
    },
    /// The user shares no room any more: nothing stored, nothing failed.
    Untracked,
}

impl Fetcher {
    /// Counts a revalidation's outcome (SPEC §5.7.4) and ends the queued
    /// revalidation of a user no longer tracked.
    pub(super) async fn revalidated(
        &self,
        due: &DueRevalidation,
        result: &Result<Fetched, FetchFailure>,
    ) {
        let outcome = match result {
            Ok(Fetched::Stored { changed: true }) => {
                tracing::warn!(user = %due.user, "revalidation found a list that differed from the stored one");
                "diverged"
            }
            Ok(Fetched::Stored { changed: false }) => "unchanged",
            Ok(Fetched::Untracked) => {
                if let Err(e) = self
                    .in_turn(|| self.store.drop_revalidation(&due.user))
                    .await
                {
                    tracing::debug!(error = %e, "cannot drop the revalidation of an untracked user");
                }
                "untracked"
            }
            Err(_) => "failed",
        };
        self.metrics.revalidation(outcome);
    }

    /// Fetches and stores one user.
    pub(super) async fn fetch_user(&self, asked: Asked<'_>) -> Result<Fetched, FetchFailure> {
        let user = asked.user();
        let server = user.server_name().as_str();
        let started = std::time::Instant::now();
        let answer = self.client.get_devices(user).await;
        let seconds = started.elapsed().as_secs_f64();
        let (list, unreadable) = match answer {
            Ok(answer) => answer,
            Err(failure) => {
                self.metrics.fetch(server, failure_label(&failure), seconds);
                return Err(failure);
            }
        };
        if unreadable > 0 {
            tracing::warn!(%user, unreadable, "left out unreadable device entries");
        }
        let written = self
            .writer
            .store(FetchedUser {
                user: user.clone(),
                stale_at_start: match asked {
                    Asked::Stale(due) => Some(due.mark.clone()),
                    Asked::Revalidation(_) => None,
                },
                revalidation: matches!(asked, Asked::Revalidation(_)),
                list,
            })
            .await;
        let plan = match written {
            Written::Stored(plan) => plan,
            Written::Refused(FetchRefusal::Untracked) => {
                // Shares no room any more: nothing to store, nothing failed.
                self.metrics.fetch(server, "untracked", seconds);
                return Ok(Fetched::Untracked);
            }
            Written::Refused(refusal) => {
                self.metrics.fetch(server, "user_mismatch", seconds);
                return Err(FetchFailure::new(
                    FailureKind::WrongUser,
                    format!("answer refused: {refusal:?}"),
                ));
            }
            Written::Failed(e) => {
                return Err(FetchFailure::new(FailureKind::Local, e.to_string()));
            }
        };
        self.metrics.fetch(
            server,
            if plan.too_many_devices.is_some() {
                "too_many_devices"
            } else {
                "stored"
            },
            seconds,
        );
        if !plan.skipped_devices.is_empty() {
            tracing::warn!(%user, devices = ?plan.skipped_devices, "skipped devices whose keys name another user or device");
        }
        if !plan.skipped_keys.is_empty() {
            tracing::warn!(%user, keys = ?plan.skipped_keys, "ignored malformed cross-signing keys");
        }
        if let Some(count) = plan.too_many_devices {
            tracing::warn!(%user, count, "device list over DLU_MAX_DEVICES not stored");
        }
        Ok(Fetched::Stored {
            changed: !plan.events.is_empty(),
        })
    }
}

/// The metric label of a failed fetch.
fn failure_label(failure: &FetchFailure) -> &'static str {
    match (failure.kind, blame(failure.kind)) {
        (FailureKind::Status(429), _) => "rate_limited",
        (_, Blame::Server) => "failed",
        (FailureKind::Status(_), Blame::User) => "refused_by_server",
        (FailureKind::WrongUser, _) => "user_mismatch",
        (_, Blame::User) => "unusable_answer",
        (_, Blame::Local) => "local_error",
    }
}
