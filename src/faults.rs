//! Fault injection for the crash tests (`DLU_FAULT`, the `fault` setting).
//!
//! Compiled only with the `testkit` feature, which only test builds enable
//! (the crate's dev-dependency on itself): in the release binary
//! [`Faults`] is empty and [`Faults::crash_point`] does nothing.

/// Where the process aborts, to prove that a crash there loses nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Right after a batch commits, before publish and ack.
    CrashAfterCommit,
    /// Right after events are published, before they leave the outbox.
    CrashAfterPublish,
    /// Right after the first chunk of a room sweep commits.
    CrashAfterSweepChunk,
    /// Not a crash: room sweeps do not run, so a test can see what holds
    /// between our server leaving a room and the sweep of its members.
    HoldSweeps,
    /// Not a crash: a finished fetch job is taken out of its stream but
    /// the reply is reported lost (as in a leader election), so taking it
    /// out is tried again.
    LoseJobAckReply,
    /// Not a crash: a woken fetch job's waiting message is deleted, but the
    /// publish of the job replacing it fails (as in a leader election).
    FailWakePublish,
    /// Not a crash: the revalidation pacer queues revalidations but the
    /// jobs of their servers are not enqueued at first.
    FailRevalidationEnqueue,
    /// Not a crash: the start-up rescan's first enqueue fails.
    FailRescanEnqueue,
}

/// The fault a worker was configured with (none outside test builds).
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    #[cfg(feature = "testkit")]
    armed: Option<Fault>,
}

impl Faults {
    /// Arms `fault` (test builds only).
    #[cfg(feature = "testkit")]
    pub fn armed(fault: Option<Fault>) -> Faults {
        Faults { armed: fault }
    }

    /// Whether `fault` is armed (always false outside test builds).
    #[inline]
    pub fn is_armed(&self, fault: Fault) -> bool {
        #[cfg(feature = "testkit")]
        return self.armed == Some(fault);
        #[cfg(not(feature = "testkit"))]
        {
            let _ = fault;
            false
        }
    }

    /// Aborts the process if `point` is the armed fault.
    #[inline]
    pub fn crash_point(&self, point: Fault) {
        #[cfg(feature = "testkit")]
        if self.armed == Some(point) {
            tracing::error!(?point, "fault injection: crashing");
            std::process::abort();
        }
        #[cfg(not(feature = "testkit"))]
        let _ = point;
    }
}
