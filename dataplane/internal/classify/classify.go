// Package classify decides a request's traffic class (SPEC §1, §7 step 3):
// interactive, agent or batch, and why.
//
// The class comes from the credential (the key's, else the team's). Only
// when the credential names none do the org's classification rules apply,
// in order, and when none matches the org's default class (interactive
// when the org sets none). Rules classify load: they never grant access or
// change what a credential may use, and a credential's own class always
// wins over them.
//
// Behavioural demotion then looks at every interactive result, whatever
// its origin: a request whose estimated prompt exceeds the org's threshold,
// or whose key already has the org's maximum of interactive requests in
// flight, is admitted as agent. A person types short prompts and waits for
// one answer at a time; an agent hiding behind a personal key or a browser
// User-Agent does neither, so it cannot take the humans' share. Demotion
// only ever moves interactive to agent: it never promotes.
//
// The package is pure: it imports only the config contract, so the
// gateway, tests and benchmarks all classify the same way.
package classify

import (
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"strings"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Reasons a class was chosen, as they appear in the response header, the
// usage event, metrics and the access log. A rule's reason is
// ReasonRulePrefix followed by its index in the org's list (0-based, as
// the admin API names it: rules[0]); a demotion's is ReasonDemotedPrefix
// followed by DemotedPromptTokens or DemotedInFlight.
const (
	ReasonCredential    = "credential"
	ReasonDefault       = "default"
	ReasonRulePrefix    = "rule:"
	ReasonDemotedPrefix = "demoted:"

	// DemotedPromptTokens: the estimated prompt exceeded
	// Demotion.max_prompt_tokens.
	DemotedPromptTokens = "prompt_tokens"
	// DemotedInFlight: the key already had
	// Demotion.max_interactive_in_flight_per_key interactive requests in
	// flight.
	DemotedInFlight = "in_flight"
)

// Default engine priorities per class (vLLM: lower is scheduled earlier;
// a request without one has 0). Interactive keeps vLLM's default so an
// engine shared with clients that send no priority treats people as it
// always did; agents and batch queue behind them, batch last.
const (
	DefaultPriorityInteractive int32 = 0
	DefaultPriorityAgent       int32 = 10
	DefaultPriorityBatch       int32 = 20
)

// Result is a classification: the class and the reason it was chosen.
type Result struct {
	Class  configv1.TrafficClass
	Reason string
}

// Input is what one request offers the classifier.
type Input struct {
	// KeyClass and TeamClass are the credential's classes; unspecified
	// means "names none".
	KeyClass  configv1.TrafficClass
	TeamClass configv1.TrafficClass
	// Header is the request's headers (canonical keys, as net/http gives
	// them).
	Header http.Header
	// PromptTokens is the estimated prompt size in tokens.
	PromptTokens int64
	// InteractiveInFlight is the number of the key's interactive requests
	// already in flight, not counting this one.
	InteractiveInFlight int64
}

type rule struct {
	header string // canonical
	re     *regexp.Regexp
	class  configv1.TrafficClass
}

// Policy is an org's compiled traffic settings. It is immutable and safe
// for concurrent use; build it once per snapshot with Compile.
type Policy struct {
	defaultClass      configv1.TrafficClass
	rules             []rule
	maxPromptTokens   int64
	maxInFlightPerKey int64
}

// FieldError is a settings field Compile refuses. Field is the path in
// OrgTraffic ("rules[2].pattern").
type FieldError struct {
	Field  string
	Reason string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Reason }

// Valid reports whether c is one of the three classes.
func Valid(c configv1.TrafficClass) bool {
	switch c {
	case configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE, configv1.TrafficClass_TRAFFIC_CLASS_AGENT,
		configv1.TrafficClass_TRAFFIC_CLASS_BATCH:
		return true
	}
	return false
}

// Name is the class's lowercase name ("interactive", "agent", "batch"), or
// "" for unspecified and unknown values.
func Name(c configv1.TrafficClass) string {
	switch c {
	case configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE:
		return "interactive"
	case configv1.TrafficClass_TRAFFIC_CLASS_AGENT:
		return "agent"
	case configv1.TrafficClass_TRAFFIC_CLASS_BATCH:
		return "batch"
	}
	return ""
}

// Compile checks and compiles t (nil: no rules, interactive default, no
// demotion). It reports the first invalid field: the control plane
// validates the same rules, so an error here means a snapshot that did not
// come from it.
func Compile(t *configv1.OrgTraffic) (*Policy, error) {
	p := &Policy{defaultClass: configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE}
	if dc := t.GetDefaultClass(); dc != configv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED {
		if !Valid(dc) {
			return nil, &FieldError{"default_class", fmt.Sprintf("unknown traffic class %d", dc)}
		}
		p.defaultClass = dc
	}
	for i, r := range t.GetRules() {
		f := "rules[" + strconv.Itoa(i) + "]"
		if r.GetHeader() == "" {
			return nil, &FieldError{f + ".header", "required"}
		}
		re, err := regexp.Compile(r.GetPattern())
		if err != nil {
			return nil, &FieldError{f + ".pattern", err.Error()}
		}
		if !Valid(r.GetTrafficClass()) {
			return nil, &FieldError{f + ".traffic_class", "must be interactive, agent or batch"}
		}
		p.rules = append(p.rules, rule{header: http.CanonicalHeaderKey(r.GetHeader()), re: re, class: r.GetTrafficClass()})
	}
	d := t.GetDemotion()
	if d.GetMaxPromptTokens() < 0 {
		return nil, &FieldError{"demotion.max_prompt_tokens", "must not be negative"}
	}
	if d.GetMaxInteractiveInFlightPerKey() < 0 {
		return nil, &FieldError{"demotion.max_interactive_in_flight_per_key", "must not be negative"}
	}
	p.maxPromptTokens, p.maxInFlightPerKey = d.GetMaxPromptTokens(), d.GetMaxInteractiveInFlightPerKey()
	return p, nil
}

// Classify returns in's class and reason. A nil Policy classifies as the
// zero OrgTraffic does.
func (p *Policy) Classify(in Input) Result {
	if p == nil {
		p = &Policy{defaultClass: configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE}
	}
	r := p.base(in)
	if r.Class != configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE {
		return r
	}
	switch {
	case p.maxPromptTokens > 0 && in.PromptTokens > p.maxPromptTokens:
		return Result{configv1.TrafficClass_TRAFFIC_CLASS_AGENT, ReasonDemotedPrefix + DemotedPromptTokens}
	case p.maxInFlightPerKey > 0 && in.InteractiveInFlight >= p.maxInFlightPerKey:
		return Result{configv1.TrafficClass_TRAFFIC_CLASS_AGENT, ReasonDemotedPrefix + DemotedInFlight}
	}
	return r
}

// base is the class before demotion. A credential class that is not one
// of the three (a newer snapshot's value) is treated as naming none.
func (p *Policy) base(in Input) Result {
	if Valid(in.KeyClass) {
		return Result{in.KeyClass, ReasonCredential}
	}
	if Valid(in.TeamClass) {
		return Result{in.TeamClass, ReasonCredential}
	}
	for i, r := range p.rules {
		if matches(r, in.Header) {
			return Result{r.class, ReasonRulePrefix + strconv.Itoa(i)}
		}
	}
	return Result{p.defaultClass, ReasonDefault}
}

// matches reports whether any value of the rule's header matches its
// pattern. An absent header never matches, even a pattern matching "".
func matches(r rule, h http.Header) bool {
	vs, ok := h[r.header]
	if !ok {
		// Headers built by hand may not be canonical.
		for k, v := range h {
			if strings.EqualFold(k, r.header) {
				vs = v
				break
			}
		}
	}
	for _, v := range vs {
		if r.re.MatchString(v) {
			return true
		}
	}
	return false
}

// EnginePriority is the vLLM `priority` to send for class c to a
// deployment with traffic settings t. send is false when the deployment
// does not run priority scheduling: vLLM rejects a priority it cannot
// schedule, so none is sent (and a client's own is removed either way).
func EnginePriority(t *configv1.DeploymentTraffic, c configv1.TrafficClass) (priority int32, send bool) {
	if !t.GetPriorityScheduling() {
		return 0, false
	}
	cp := t.GetClassPriority()
	switch c {
	case configv1.TrafficClass_TRAFFIC_CLASS_AGENT:
		if cp != nil && cp.Agent != nil {
			return cp.GetAgent(), true
		}
		return DefaultPriorityAgent, true
	case configv1.TrafficClass_TRAFFIC_CLASS_BATCH:
		if cp != nil && cp.Batch != nil {
			return cp.GetBatch(), true
		}
		return DefaultPriorityBatch, true
	}
	if cp != nil && cp.Interactive != nil {
		return cp.GetInteractive(), true
	}
	return DefaultPriorityInteractive, true
}

// Fallback is the policy of an org whose settings Compile refused: it
// opens nothing. No rules apply (a rule that cannot be read must not
// classify anything); the default class is the org's when that is one of
// the three, else interactive; demotion thresholds are kept when they are
// valid (non-negative), so that an org that demotes keeps demoting.
func Fallback(t *configv1.OrgTraffic) *Policy {
	p := &Policy{defaultClass: configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE}
	if dc := t.GetDefaultClass(); Valid(dc) {
		p.defaultClass = dc
	}
	if d := t.GetDemotion(); d.GetMaxPromptTokens() >= 0 && d.GetMaxInteractiveInFlightPerKey() >= 0 {
		p.maxPromptTokens, p.maxInFlightPerKey = d.GetMaxPromptTokens(), d.GetMaxInteractiveInFlightPerKey()
	}
	return p
}

// Demotes reports whether p demotes by the key's interactive requests in
// flight (the gateway counts them only then).
func (p *Policy) Demotes() bool { return p != nil && p.maxInFlightPerKey > 0 }
