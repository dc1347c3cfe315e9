package classify

import (
	"net/http"
	"strconv"
	"strings"
	"testing"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// FuzzClassify feeds client-controlled header values (and arbitrary rule
// patterns) through Compile and Classify and checks the invariants: a
// known class and a well-formed reason; a credential's class stands
// unless demoted from interactive to agent; demotion never promotes.
func FuzzClassify(f *testing.F) {
	f.Add("claude-code/1.0", "^claude-code/", int32(2), int32(0), int32(0), int64(10), int64(0))
	f.Add("Mozilla/5.0", "Mozilla", int32(1), int32(1), int32(0), int64(9000), int64(2))
	f.Add("", "^$", int32(3), int32(0), int32(3), int64(0), int64(0))
	f.Add("\xff\xfe", "(?i)\\x{fffd}", int32(2), int32(2), int32(1), int64(-1), int64(-5))
	f.Fuzz(func(t *testing.T, value, pattern string, ruleClass, keyClass, teamClass int32, prompt, inFlight int64) {
		o := &configv1.OrgTraffic{
			Rules:    []*configv1.ClassificationRule{{Header: "User-Agent", Pattern: pattern, TrafficClass: configv1.TrafficClass(ruleClass)}},
			Demotion: &configv1.Demotion{MaxPromptTokens: 8000, MaxInteractiveInFlightPerKey: 1},
		}
		p, err := Compile(o)
		if err != nil {
			return // the control plane refuses these too
		}
		in := Input{KeyClass: configv1.TrafficClass(keyClass), TeamClass: configv1.TrafficClass(teamClass),
			Header: http.Header{"User-Agent": {value}}, PromptTokens: prompt, InteractiveInFlight: inFlight}
		r := p.Classify(in)
		if !Valid(r.Class) {
			t.Fatalf("invalid class %v", r.Class)
		}
		cred := in.KeyClass
		if !Valid(cred) {
			cred = in.TeamClass
		}
		switch {
		case r.Reason == ReasonCredential:
			if r.Class != cred {
				t.Fatalf("credential reason with class %v, credential %v", r.Class, cred)
			}
		case strings.HasPrefix(r.Reason, ReasonDemotedPrefix):
			why := strings.TrimPrefix(r.Reason, ReasonDemotedPrefix)
			if r.Class != agent || (why != DemotedPromptTokens && why != DemotedInFlight) {
				t.Fatalf("bad demotion %+v", r)
			}
			if Valid(cred) && cred != interactive {
				t.Fatalf("demoted a %v credential", cred)
			}
		case Valid(cred):
			t.Fatalf("credential class %v overridden: %+v", cred, r)
		case r.Reason == ReasonDefault:
			if r.Class != interactive {
				t.Fatalf("default is interactive here, got %v", r.Class)
			}
		case strings.HasPrefix(r.Reason, ReasonRulePrefix):
			if n, err := strconv.Atoi(strings.TrimPrefix(r.Reason, ReasonRulePrefix)); err != nil || n != 0 {
				t.Fatalf("bad rule reason %q", r.Reason)
			}
			if r.Class != configv1.TrafficClass(ruleClass) {
				t.Fatalf("rule class %v, got %v", ruleClass, r.Class)
			}
		default:
			t.Fatalf("unknown reason %q", r.Reason)
		}
	})
}
