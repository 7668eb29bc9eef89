//! The arguments of the operators' verbs (approve, reject, reconcile, answer, cancel, purge,
//! events): who and why, and the held call a decision is bound to.

use clap::Args;

use super::args_demo::ShopArg;
use crate::operator::Reviewed;

#[derive(Args, Debug)]
pub struct DecideArgs {
    /// Task id (e.g. t7), or key:KEY for the task enqueued under KEY.
    pub task: String,
    /// Who decides, as recorded in the audit log.
    #[arg(long, env = "USER", default_value = "operator")]
    pub by: String,
    /// Why; recorded in the audit log.
    #[arg(long)]
    pub reason: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The held call a decision is about, as `worker show` prints it. Compared inside the
/// decision's transaction: a task that moved on to another call refuses the decision.
#[derive(Args, Debug)]
pub struct CallArgs {
    /// The held call's digest of tool and args (from `worker show`).
    #[arg(long)]
    pub digest: Option<String>,
    /// The held call's call key (from `worker show`).
    #[arg(long)]
    pub key: Option<String>,
}

impl CallArgs {
    pub(super) fn reviewed(&self) -> Reviewed {
        Reviewed {
            key: self.key.clone(),
            digest: self.digest.clone(),
        }
    }
}

#[derive(Args, Debug)]
pub struct ApproveArgs {
    #[command(flatten)]
    pub decide: DecideArgs,
    /// Required: --digest or --key of the held call; refused if the task holds another call.
    #[command(flatten)]
    pub call: CallArgs,
    /// Grant more budget with the approval, e.g. `tool_calls=1,deadline_ms=10000` (each limit
    /// grows by its amount; recorded in the audit event).
    #[arg(long)]
    pub extend: Option<String>,
}

#[derive(Args, Debug)]
pub struct RejectArgs {
    #[command(flatten)]
    pub decide: DecideArgs,
    /// When given, refused if the task holds another call.
    #[command(flatten)]
    pub call: CallArgs,
}

#[derive(Args, Debug)]
pub struct ReconcileArgs {
    /// Task id (or key:KEY); without it, list the held writes.
    pub task: Option<String>,
    /// Settle every held write whose tool's lookup gives a definite answer.
    #[arg(long, conflicts_with_all = ["task", "applied", "not_applied"])]
    pub auto: bool,
    /// The write took effect.
    #[arg(long, requires = "task", conflicts_with = "not_applied")]
    pub applied: bool,
    /// The write did not take effect: send it again under the same call key.
    #[arg(long, requires = "task")]
    pub not_applied: bool,
    /// With --applied: what the write returned, as JSON (default: asked of the tool's lookup; refused when it cannot say).
    #[arg(long, requires = "applied", conflicts_with = "not_applied")]
    pub result: Option<String>,
    /// When given, refused if the task holds another call.
    #[command(flatten)]
    pub call: CallArgs,
    /// With --not-applied or --applied: grant more budget, e.g. `tool_calls=1` or
    /// `deadline_ms=10000` (each limit grows by its amount; recorded in the audit event).
    #[arg(long, requires = "task")]
    pub extend: Option<String>,
    /// Who decides, as recorded in the audit log.
    #[arg(long, env = "USER", default_value = "operator")]
    pub by: String,
    /// Why; recorded in the audit log.
    #[arg(long)]
    pub reason: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub shop: ShopArg,
}

#[derive(Args, Debug)]
pub struct AnswerArgs {
    #[command(flatten)]
    pub decide: DecideArgs,
    /// The question answered, as `worker show` prints it (--key names the step that asked,
    /// --digest the question and its choices): the answer is refused if the task asks another
    /// question meanwhile.
    #[command(flatten)]
    pub call: CallArgs,
    /// The answer, in plain words (one of the question's choices, as written, when it offers
    /// some).
    #[arg(long)]
    pub text: String,
}

#[derive(Args, Debug)]
pub struct SayArgs {
    #[command(flatten)]
    pub decide: DecideArgs,
    /// The message, in plain words (at most 4,000 characters).
    #[arg(long)]
    pub text: String,
    /// The turn you saw finish, as `worker show` prints it: the message is refused if the task
    /// moved past it, so a message sent twice opens one turn, not two.
    #[arg(long)]
    pub turn: Option<u32>,
    /// Wait for the turn to finish, print its answer and exit as `worker wait` does.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up waiting after this long (30s, 10m, 2h); exit 7.
    #[arg(long, value_name = "DURATION", value_parser = crate::clock::parse_duration_ms, requires = "wait")]
    pub timeout: Option<u64>,
    /// With --wait: settled (return at a wait on a person, exit 5) or finished.
    #[arg(long, value_enum, requires = "wait")]
    pub until: Option<super::wait::UntilArg>,
}

#[derive(Args, Debug)]
pub struct PurgeArgs {
    /// Only tasks finished (last updated) longer ago than this: 30d, 12h, 90m, 45s.
    #[arg(long, value_name = "DURATION", value_parser = crate::clock::parse_duration_ms)]
    pub finished_before: u64,
    /// Tasks deleted per transaction.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub batch: u64,
    /// Who purges, as recorded in the audit log.
    #[arg(long, env = "USER", default_value = "operator")]
    pub by: String,
    /// Why; recorded in the audit log.
    #[arg(long)]
    pub reason: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct EventsArgs {
    /// Only this task's events.
    pub task: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}
