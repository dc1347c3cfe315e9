package classify

import (
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

const (
	unset       = configv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED
	interactive = configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE
	agent       = configv1.TrafficClass_TRAFFIC_CLASS_AGENT
	batch       = configv1.TrafficClass_TRAFFIC_CLASS_BATCH
)

// orgTraffic is an org with two User-Agent rules, a nightly-job header
// rule, and both demotion thresholds.
func orgTraffic() *configv1.OrgTraffic {
	return &configv1.OrgTraffic{
		DefaultClass: unset,
		Rules: []*configv1.ClassificationRule{
			{Header: "User-Agent", Pattern: `^claude-code/`, TrafficClass: agent},
			{Header: "user-agent", Pattern: `(?i)codex`, TrafficClass: agent},
			{Header: "X-Job", Pattern: `^nightly$`, TrafficClass: batch},
			{Header: "X-Empty", Pattern: `^$`, TrafficClass: batch},
			{Header: "User-Agent", Pattern: `Mozilla`, TrafficClass: interactive},
		},
		Demotion: &configv1.Demotion{MaxPromptTokens: 8000, MaxInteractiveInFlightPerKey: 1},
	}
}

func hdr(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return h
}

func TestClassify(t *testing.T) {
	t.Parallel()
	p, err := Compile(orgTraffic())
	require.NoError(t, err)
	tests := []struct {
		name string
		in   Input
		want Result
	}{
		{"no credential class, no rule: org default (interactive)", Input{Header: hdr("User-Agent", "curl/8")}, Result{interactive, ReasonDefault}},
		{"user-agent rule", Input{Header: hdr("User-Agent", "claude-code/1.0.3")}, Result{agent, "rule:0"}},
		{"rules are ordered: the first match wins", Input{Header: hdr("User-Agent", "claude-code/1 Mozilla")}, Result{agent, "rule:0"}},
		{"second rule, lowercase header in the rule, case-insensitive pattern", Input{Header: hdr("User-Agent", "OpenAI CODEX cli")}, Result{agent, "rule:1"}},
		{"another header", Input{Header: hdr("X-Job", "nightly")}, Result{batch, "rule:2"}},
		{"anchored pattern does not match a longer value", Input{Header: hdr("X-Job", "nightly-2")}, Result{interactive, ReasonDefault}},
		{"an absent header never matches, even ^$", Input{Header: hdr()}, Result{interactive, ReasonDefault}},
		{"a present empty header matches ^$", Input{Header: hdr("X-Empty", "")}, Result{batch, "rule:3"}},
		{"any value of a repeated header matches", Input{Header: hdr("X-Job", "daily", "X-Job", "nightly")}, Result{batch, "rule:2"}},
		{"non-canonical header keys are found", Input{Header: http.Header{"user-agent": {"claude-code/2"}}}, Result{agent, "rule:0"}},
		{"rule to interactive", Input{Header: hdr("User-Agent", "Mozilla/5.0")}, Result{interactive, "rule:4"}},
		{"key class wins over a matching rule", Input{KeyClass: interactive, Header: hdr("User-Agent", "claude-code/1")}, Result{interactive, ReasonCredential}},
		{"team class wins over a matching rule", Input{TeamClass: batch, Header: hdr("User-Agent", "claude-code/1")}, Result{batch, ReasonCredential}},
		{"key class wins over the team's", Input{KeyClass: agent, TeamClass: batch}, Result{agent, ReasonCredential}},
		{"a rule cannot promote a credential's agent to interactive", Input{KeyClass: agent, Header: hdr("User-Agent", "Mozilla/5.0")}, Result{agent, ReasonCredential}},
		{"an unknown credential class names none", Input{KeyClass: configv1.TrafficClass(42), Header: hdr("X-Job", "nightly")}, Result{batch, "rule:2"}},
		{"prompt over the threshold demotes a credential's interactive", Input{KeyClass: interactive, PromptTokens: 8001}, Result{agent, "demoted:prompt_tokens"}},
		{"prompt at the threshold stays interactive", Input{KeyClass: interactive, PromptTokens: 8000}, Result{interactive, ReasonCredential}},
		{"a second interactive request in flight demotes", Input{KeyClass: interactive, InteractiveInFlight: 1}, Result{agent, "demoted:in_flight"}},
		{"the first one does not", Input{KeyClass: interactive, InteractiveInFlight: 0}, Result{interactive, ReasonCredential}},
		{"demotion applies to a rule's interactive", Input{Header: hdr("User-Agent", "Mozilla/5.0"), PromptTokens: 20000}, Result{agent, "demoted:prompt_tokens"}},
		{"demotion applies to the default", Input{InteractiveInFlight: 3}, Result{agent, "demoted:in_flight"}},
		{"prompt demotion is reported first", Input{KeyClass: interactive, PromptTokens: 9000, InteractiveInFlight: 5}, Result{agent, "demoted:prompt_tokens"}},
		{"demotion never touches agent", Input{KeyClass: agent, PromptTokens: 1e6, InteractiveInFlight: 100}, Result{agent, ReasonCredential}},
		{"demotion never touches batch", Input{TeamClass: batch, PromptTokens: 1e6, InteractiveInFlight: 100}, Result{batch, ReasonCredential}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.Equal(t, tt.want, p.Classify(tt.in))
		})
	}
}

func TestClassifyDefaults(t *testing.T) {
	t.Parallel()
	var nilPolicy *Policy
	require.Equal(t, Result{interactive, ReasonDefault}, nilPolicy.Classify(Input{PromptTokens: 1e9, InteractiveInFlight: 1e9}),
		"no settings: interactive, no demotion")
	p, err := Compile(&configv1.OrgTraffic{DefaultClass: agent})
	require.NoError(t, err)
	require.Equal(t, Result{agent, ReasonDefault}, p.Classify(Input{Header: hdr("User-Agent", "Mozilla/5.0")}))
	require.Equal(t, Result{interactive, ReasonCredential}, p.Classify(Input{KeyClass: interactive}))
	p, err = Compile(nil)
	require.NoError(t, err)
	require.Equal(t, Result{interactive, ReasonDefault}, p.Classify(Input{}))
}

func TestCompileRejects(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		mut   func(*configv1.OrgTraffic)
		field string
	}{
		{"bad regex", func(o *configv1.OrgTraffic) { o.Rules[1].Pattern = `(unclosed` }, "rules[1].pattern"},
		{"perl-only syntax RE2 refuses", func(o *configv1.OrgTraffic) { o.Rules[0].Pattern = `(?=lookahead)` }, "rules[0].pattern"},
		{"unspecified rule class", func(o *configv1.OrgTraffic) { o.Rules[2].TrafficClass = unset }, "rules[2].traffic_class"},
		{"unknown rule class", func(o *configv1.OrgTraffic) { o.Rules[0].TrafficClass = 9 }, "rules[0].traffic_class"},
		{"empty header", func(o *configv1.OrgTraffic) { o.Rules[3].Header = "" }, "rules[3].header"},
		{"unknown default class", func(o *configv1.OrgTraffic) { o.DefaultClass = 7 }, "default_class"},
		{"negative prompt threshold", func(o *configv1.OrgTraffic) { o.Demotion.MaxPromptTokens = -1 }, "demotion.max_prompt_tokens"},
		{"negative in-flight threshold", func(o *configv1.OrgTraffic) { o.Demotion.MaxInteractiveInFlightPerKey = -1 }, "demotion.max_interactive_in_flight_per_key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := orgTraffic()
			tt.mut(o)
			_, err := Compile(o)
			var fe *FieldError
			require.True(t, errors.As(err, &fe), "error %v", err)
			require.Equal(t, tt.field, fe.Field)
			require.True(t, strings.HasPrefix(err.Error(), tt.field+": "))
		})
	}
}

func TestEnginePriority(t *testing.T) {
	t.Parallel()
	i32 := func(v int32) *int32 { return &v }
	prio := &configv1.DeploymentTraffic{PriorityScheduling: true}
	custom := &configv1.DeploymentTraffic{PriorityScheduling: true,
		ClassPriority: &configv1.ClassPriorities{Interactive: i32(-5), Batch: i32(0)}}
	tests := []struct {
		name string
		t    *configv1.DeploymentTraffic
		c    configv1.TrafficClass
		want int32
		send bool
	}{
		{"no settings: nothing sent", nil, interactive, 0, false},
		{"fcfs deployment: nothing sent", &configv1.DeploymentTraffic{ClassPriority: custom.ClassPriority}, agent, 0, false},
		{"default interactive", prio, interactive, DefaultPriorityInteractive, true},
		{"default agent", prio, agent, DefaultPriorityAgent, true},
		{"default batch", prio, batch, DefaultPriorityBatch, true},
		{"unspecified is treated as interactive", prio, unset, DefaultPriorityInteractive, true},
		{"custom interactive", custom, interactive, -5, true},
		{"custom 0 is set, not unset", custom, batch, 0, true},
		{"unset field keeps its default", custom, agent, DefaultPriorityAgent, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, send := EnginePriority(tt.t, tt.c)
			require.Equal(t, tt.send, send)
			require.Equal(t, tt.want, got)
		})
	}
	require.Less(t, DefaultPriorityInteractive, DefaultPriorityAgent)
	require.Less(t, DefaultPriorityAgent, DefaultPriorityBatch)
}

func TestNames(t *testing.T) {
	t.Parallel()
	require.Equal(t, "interactive", Name(interactive))
	require.Equal(t, "agent", Name(agent))
	require.Equal(t, "batch", Name(batch))
	require.Equal(t, "", Name(unset))
	require.False(t, Valid(unset))
	require.False(t, Valid(4))
}
