// Package routing decides which deployments may serve a request and in
// which order to try them, as pure functions over the catalog: model
// resolution through aliases (ResolveGroup), the allowed_models of every
// level (AllowedDeployments), the capabilities a request needs
// (Requirements, Filter), the key's tag pool (TagPool) and the weighted
// order (WeightedShuffle). Nothing here does I/O or reads runtime state,
// so a control-plane "explain this decision" can run the same code over a
// snapshot; the gateway adds what is runtime (credential errors, health)
// between these steps.
package routing

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// ResolveGroup maps a requested model name to a model group: the key's
// alias map first, then the team's (SPEC §7.2). Names without an alias are
// group names.
func ResolveGroup(p *authn.Principal, requested string) string {
	if g, ok := p.Key.GetModelGroupAliases()[requested]; ok {
		return g
	}
	if g, ok := p.Team.GetModelGroupAliases()[requested]; ok {
		return g
	}
	return requested
}

// allowedLevels returns the allowed_models lists of the principal's
// levels that set one (key, team, user, org) and of the end customer
// named by x-sluice-end-user (cu, may be nil). Team-member limits carry no
// allowed_models (the admin API refuses it).
func allowedLevels(p *authn.Principal, cu *configv1.Customer) [][]string {
	var out [][]string
	for _, l := range []*configv1.Limits{p.Key.GetLimits(), p.Team.GetLimits(), p.User.GetLimits(), p.Org.GetLimits(), cu.GetLimits()} {
		if m := l.GetAllowedModels(); len(m) > 0 {
			out = append(out, m)
		}
	}
	return out
}

// AllowedDeployments filters deps to those every level permits: a level
// permits the whole group when it lists the group's name, else the
// deployments whose upstream model it lists. ok is false when nothing is
// permitted (an empty group counts as permitted when every level lists
// the group).
func AllowedDeployments(p *authn.Principal, cu *configv1.Customer, group string, deps []*catalog.Deployment) (out []*catalog.Deployment, ok bool) {
	levels := allowedLevels(p, cu)
	if len(levels) == 0 {
		return deps, true
	}
	groupOK := true
	out = deps
	for _, l := range levels {
		if slices.Contains(l, group) {
			continue
		}
		groupOK = false
		var keep []*catalog.Deployment
		for _, d := range out {
			if slices.Contains(l, d.GetUpstreamModel()) {
				keep = append(keep, d)
			}
		}
		out = keep
	}
	return out, groupOK || len(out) > 0
}

// Requirements are what a request needs of a deployment, extracted from
// it once (RequirementsOf).
type Requirements struct {
	// Tools: tool calling (tools or functions, ToolsParam naming the one
	// sent).
	Tools      bool
	ToolsParam string
	// JSONMode: a response_format other than text.
	JSONMode bool
	// Vision: image parts in messages.
	Vision bool
	// InputTokens estimates the prompt (0: none), InputParam names the
	// parameter carrying it.
	InputTokens int64
	InputParam  string
	// OutputTokens is the request's max_tokens or max_completion_tokens
	// (0: unset), OutputParam the one sent.
	OutputTokens int64
	OutputParam  string
}

// RequirementsOf extracts the requirements of req on route.
func RequirementsOf(route string, req *openai.Request) Requirements {
	r := Requirements{Tools: req.Tools(), ToolsParam: "tools", JSONMode: req.JSONMode(), Vision: req.Images(),
		InputTokens: req.PromptEstimate(), InputParam: openai.PromptParam(route),
		OutputTokens: req.MaxTokens(), OutputParam: req.MaxTokensParam()}
	if req.Value("tools") == nil {
		r.ToolsParam = "functions"
	}
	return r
}

// capabilityFilter is one capability a request may need.
type capabilityFilter struct {
	param func(Requirements) string
	need  func(Requirements) bool
	has   func(*configv1.Capabilities, Requirements) bool
	// what describes the need, for the error (formatted only then).
	what func(Requirements) string
}

// capabilityFilters are the filters in the order they apply.
var capabilityFilters = [...]capabilityFilter{
	{func(r Requirements) string { return r.ToolsParam }, func(r Requirements) bool { return r.Tools },
		func(c *configv1.Capabilities, _ Requirements) bool { return c.GetTools() },
		func(Requirements) string { return "tool calling" }},
	{func(Requirements) string { return "response_format" }, func(r Requirements) bool { return r.JSONMode },
		func(c *configv1.Capabilities, _ Requirements) bool { return c.GetJsonMode() },
		func(Requirements) string { return "JSON mode (response_format)" }},
	{func(Requirements) string { return "messages" }, func(r Requirements) bool { return r.Vision },
		func(c *configv1.Capabilities, _ Requirements) bool { return c.GetVision() },
		func(Requirements) string { return "image input" }},
	{func(r Requirements) string { return r.InputParam }, func(r Requirements) bool { return r.InputTokens > 0 },
		func(c *configv1.Capabilities, r Requirements) bool {
			return c.GetMaxInputTokens() == 0 || r.InputTokens <= c.GetMaxInputTokens()
		},
		func(r Requirements) string { return fmt.Sprintf("a prompt of about %d tokens", r.InputTokens) }},
	{func(r Requirements) string { return r.OutputParam }, func(r Requirements) bool { return r.OutputTokens > 0 },
		func(c *configv1.Capabilities, r Requirements) bool {
			return c.GetMaxOutputTokens() == 0 || r.OutputTokens <= c.GetMaxOutputTokens()
		},
		func(r Requirements) string { return fmt.Sprintf("%s=%d", r.OutputParam, r.OutputTokens) }},
}

// Filter keeps the deployments of group that meet req, filter by filter;
// when a filter leaves none the answer is 400 unsupported_parameter naming
// the parameter.
func Filter(group string, req Requirements, deps []*catalog.Deployment) ([]*catalog.Deployment, *openai.Error) {
	for i := range capabilityFilters {
		f := &capabilityFilters[i]
		if !f.need(req) {
			continue
		}
		if len(deps) == 1 && f.has(deps[0].GetCapabilities(), req) {
			continue // the common single-deployment case: no new slice
		}
		var keep []*catalog.Deployment
		for _, d := range deps {
			if f.has(d.GetCapabilities(), req) {
				keep = append(keep, d)
			}
		}
		if len(keep) == 0 {
			return nil, openai.InvalidRequest(openai.CodeUnsupportedParameter, f.param(req),
				fmt.Sprintf("no deployment of model %q supports %s", group, f.what(req)))
		}
		deps = keep
	}
	return deps, nil
}

// TagPool picks the deployments of the key's tag pool: those carrying one
// of the key's tags if any does; else the untagged ones (the default
// pool); else all.
func TagPool(deps []*catalog.Deployment, tags []string) []*catalog.Deployment {
	var tagged, untagged []*catalog.Deployment
	for _, d := range deps {
		dt := d.GetTags()
		if len(dt) == 0 {
			untagged = append(untagged, d)
			continue
		}
		for _, t := range tags {
			if slices.Contains(dt, t) {
				tagged = append(tagged, d)
				break
			}
		}
	}
	switch {
	case len(tagged) > 0:
		return tagged
	case len(untagged) > 0:
		return untagged
	}
	return deps
}

// WeightedShuffle orders items by weighted sampling without replacement
// (Efraimidis–Spirakis: sort by u^(1/w) descending), so the first is
// picked with probability weight/total and retries follow the same law.
// Weights below 1 count as 1.
func WeightedShuffle[T any](items []T, weight func(T) int64) {
	if len(items) < 2 {
		return
	}
	keys := make([]float64, len(items))
	for i, c := range items {
		w := float64(max(weight(c), 1))
		keys[i] = math.Pow(rand.Float64(), 1/w)
	}
	idx := make([]int, len(items))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int {
		switch {
		case keys[a] > keys[b]:
			return -1
		case keys[a] < keys[b]:
			return 1
		}
		return 0
	})
	out := make([]T, len(items))
	for i, j := range idx {
		out[i] = items[j]
	}
	copy(items, out)
}
