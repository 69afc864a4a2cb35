//! Retention hints: what the application serving a request knows about its conversation.
//!
//! An agent framework knows its loop calls the model again once a tool returns; a chat front
//! end knows whether a session is still open. Either can say so per request, and a policy that
//! reads hints ([`Policy::on_request_hint`](crate::Policy::on_request_hint)) can keep the
//! chunks of conversations that come back and give up those of conversations that ended.
//! A hint is advice: a policy that reads one must still evict a hinted chunk when nothing else
//! can go, and must not trust a hint further than the traffic shows it is right.

/// One request's retention hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RetentionHint {
    /// The application will send another request that extends this one's prefix.
    Continues,
    /// The conversation or session is over: chunks only it used are worth nothing now.
    Ends,
}

impl RetentionHint {
    /// The hint's wire name (`"continues"`, `"ends"`).
    pub fn name(self) -> &'static str {
        match self {
            RetentionHint::Continues => "continues",
            RetentionHint::Ends => "ends",
        }
    }

    /// The hint named `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "continues" => Some(RetentionHint::Continues),
            "ends" => Some(RetentionHint::Ends),
            _ => None,
        }
    }
}
