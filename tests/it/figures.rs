//! Every table of the design document, figure for figure: the outputs of this crate's kernel
//! compared byte for byte with what the reference programs print (captured in tests/fixtures).

use tether::kernel::Budget;
use tether::sim::{demos, random_workload, scenario_table};

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}.txt", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn scenario_table_a_to_h() {
    assert_eq!(scenario_table(), fixture("scenarios"));
}

#[test]
fn span_table_of_scenario_a() {
    assert_eq!(demos::trace_demo(), fixture("trace"));
}

#[test]
fn postmortems_of_b_c_d_h() {
    assert_eq!(demos::postmortem_demo(), fixture("postmortem"));
}

#[test]
fn state_view_versus_full_transcript() {
    let out = demos::context_growth_demo();
    assert_eq!(out, fixture("context_growth"));
    assert!(out.contains("   8       1149            7979       8084           32080"));
}

#[test]
fn suspend_and_resume_twice_from_one_snapshot() {
    let out = demos::resume_demo();
    assert_eq!(out, fixture("resume"));
    assert!(out.contains("budgets carried : tokens 708 elapsed 11.2"));
}

#[test]
fn record_and_replay() {
    assert_eq!(demos::replay_demo(), fixture("replay"));
}

#[test]
fn plan_validation_messages() {
    assert_eq!(demos::plan_demo(), fixture("plan"));
}

#[test]
fn memory_policy() {
    assert_eq!(demos::memory_demo(), fixture("memory"));
}

#[test]
fn random_models_same_distribution_as_reference() {
    let budget = Budget::default();
    let sum = random_workload(0..2000, budget);
    assert_eq!(demos::random_report(&sum, &budget), fixture("random"));
}

#[test]
fn compounding_error_table() {
    assert_eq!(demos::compounding_demo(), fixture("compounding"));
}

#[test]
fn choosing_limits_table() {
    assert_eq!(demos::limits_demo(), fixture("limits"));
}

/// Every view the model was shown in scenarios A, D and G, byte for byte as the reference's
/// `render` wrote it (captured in tests/fixtures/views.jsonl).
#[test]
fn views_are_byte_identical_to_the_reference() {
    struct Spy {
        inner: Box<dyn tether::model::Model>,
        views: Vec<String>,
    }
    impl tether::model::Model for Spy {
        fn next(&mut self, req: &tether::kernel::ModelRequest<'_>) -> tether::kernel::ModelReply {
            self.views.push(req.view.to_string());
            self.inner.next(req)
        }
    }
    let want = fixture_file("views.jsonl");
    let mut expected: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for line in want.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("fixture line");
        let name = v["scenario"].as_str().expect("scenario").to_string();
        expected
            .entry(name)
            .or_default()
            .push(v["view"].as_str().expect("view").to_string());
    }
    for sc in tether::sim::scenarios() {
        let letter = sc.name[..1].to_string();
        let Some(want) = expected.get(&letter) else {
            continue;
        };
        let mut spy = Spy {
            inner: sc.model.build(),
            views: Vec::new(),
        };
        tether::sim::go(&mut spy, sc.budget, sc.store());
        assert_eq!(&spy.views, want, "scenario {letter}");
    }
    assert_eq!(expected.len(), 3);
}

fn fixture_file(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}
