//! The input kinds: the one place that knows which inputs exist (SPEC §4.1).
//!
//! Each kind has its default subject, its setting and its parser here, in
//! matches the compiler checks. `docs/design.md` ("Adding an input kind")
//! lists what else a new kind needs; every other place that treats kinds
//! differently matches on [`InputKind`] or [`super::InputMessage`] without a
//! catch-all arm, so the compiler points at each.

use super::membership::{MemberKeyLink, MembershipChange};
use super::{
    DeadReason, DeviceListUpdate, InputMessage, Rejection, ResyncRequest, SigningKeyUpdate,
};

/// Which input a message came from, decided by its subject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, strum::VariantArray)]
pub enum InputKind {
    /// `m.device_list_update` contents.
    Update,
    /// `m.signing_key_update` contents.
    SigningKey,
    /// A request to fetch a user's list again.
    Resync,
    /// A room membership change (SPEC §5.5).
    Membership,
    /// An MSC4430 member key's link to its user (SPEC §5.6).
    MemberKey,
}

impl InputKind {
    /// Every kind (derived, so a new variant is in it).
    pub const ALL: &'static [InputKind] = <InputKind as strum::VariantArray>::VARIANTS;

    /// The subject used when its setting is not given.
    pub fn default_subject(self) -> &'static str {
        match self {
            InputKind::Update => "devicelist.in.update",
            InputKind::SigningKey => "devicelist.in.signing_key",
            InputKind::Resync => "devicelist.in.resync",
            InputKind::Membership => "devicelist.in.membership",
            InputKind::MemberKey => "devicelist.in.member_key",
        }
    }

    /// The kind's name as one subject token (the last token of its
    /// default subject), used in the subjects of the input partitions.
    pub fn token(self) -> &'static str {
        match self {
            InputKind::Update => "update",
            InputKind::SigningKey => "signing_key",
            InputKind::Resync => "resync",
            InputKind::Membership => "membership",
            InputKind::MemberKey => "member_key",
        }
    }

    /// Whether messages of this kind are about rooms (SPEC §5.5): acked and
    /// ignored while membership is off, and exempt from the own-user and
    /// `origin` rules (our own users' memberships are what make a room ours).
    pub fn is_room_input(self) -> bool {
        match self {
            InputKind::Membership | InputKind::MemberKey => true,
            InputKind::Update | InputKind::SigningKey | InputKind::Resync => false,
        }
    }

    /// Parses a body of this kind (size already checked). `member_keys`:
    /// MSC4430 member keys are accepted (SPEC §5.6); without it a member
    /// key is a malformed identity.
    pub fn parse_body(self, body: &[u8], member_keys: bool) -> Result<InputMessage, Rejection> {
        Ok(match self {
            InputKind::Update => InputMessage::Update(DeviceListUpdate::parse(body)?),
            InputKind::SigningKey => InputMessage::SigningKey(SigningKeyUpdate::parse(body)?),
            InputKind::Resync => InputMessage::Resync(ResyncRequest::parse(body)?),
            InputKind::Membership => {
                InputMessage::Membership(MembershipChange::parse(body, member_keys)?)
            }
            InputKind::MemberKey if member_keys => {
                InputMessage::MemberKey(MemberKeyLink::parse(body)?)
            }
            InputKind::MemberKey => {
                return Err(Rejection::new(
                    DeadReason::InvalidIdentity,
                    "member keys are not accepted (DLU_MSC4430 is off)",
                ));
            }
        })
    }
}

/// The configured subject of every input kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputSubjects(Vec<(InputKind, String)>);

impl InputSubjects {
    /// The subjects `subject_of` gives for each kind.
    pub fn new<S: Into<String>>(subject_of: impl Fn(InputKind) -> S) -> InputSubjects {
        InputSubjects(
            InputKind::ALL
                .iter()
                .map(|&kind| (kind, subject_of(kind).into()))
                .collect(),
        )
    }

    /// The kind of message on `subject`.
    pub fn kind_of(&self, subject: &str) -> Option<InputKind> {
        self.0
            .iter()
            .find(|(_, s)| s == subject)
            .map(|(kind, _)| *kind)
    }

    /// The subject of `kind`.
    pub fn subject(&self, kind: InputKind) -> &str {
        self.0
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or_else(|| kind.default_subject(), |(_, s)| s.as_str())
    }

    /// Every subject, in kind order.
    pub fn all(&self) -> Vec<String> {
        self.0.iter().map(|(_, s)| s.clone()).collect()
    }
}

impl Default for InputSubjects {
    fn default() -> Self {
        InputSubjects::new(InputKind::default_subject)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_own_subject() {
        let subjects = InputSubjects::default();
        for &kind in InputKind::ALL {
            assert_eq!(subjects.kind_of(kind.default_subject()), Some(kind));
            assert!(kind.default_subject().starts_with("devicelist.in."));
        }
        assert_eq!(subjects.kind_of("devicelist.in.other"), None);
    }

    #[test]
    fn each_token_ends_its_default_subject() {
        for &kind in InputKind::ALL {
            assert_eq!(
                kind.default_subject().rsplit('.').next(),
                Some(kind.token())
            );
        }
    }
}
