package proxy

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Passive health (SPEC §7.3): consecutive connect failures or 5xx answers
// eject a deployment with exponential backoff; a 429/503 with Retry-After
// parks it for that long, capped. When every candidate of a pool is
// ejected the pool is used anyway (a pool is never emptied by ejections).
const (
	ejectAfterFailures = 3
	ejectBase          = time.Second
	ejectMax           = 30 * time.Second
	parkMax            = 60 * time.Second
)

// depState is the in-process state of one deployment.
type depState struct {
	// inFlight counts this instance's requests at the deployment; it
	// enforces max_concurrency per instance only (see docs/proxy.md: the
	// cluster-wide lease belongs to the limits issue).
	inFlight     atomic.Int64
	ejectedUntil atomic.Int64 // unix nanoseconds; 0: healthy
	// credErr is the last credential error logged, so each distinct
	// error is logged once per deployment.
	credErr atomic.Pointer[string]

	mu       sync.Mutex
	failures int
	backoff  time.Duration
}

// states holds a depState per deployment id. Entries of deleted
// deployments stay (a few bytes each) so that a re-created id keeps no
// surprising state beyond its health.
type states struct{ m sync.Map }

func (s *states) get(id string) *depState {
	if v, ok := s.m.Load(id); ok {
		return v.(*depState)
	}
	v, _ := s.m.LoadOrStore(id, new(depState))
	return v.(*depState)
}

func (st *depState) ejected(now time.Time) bool { return st.ejectedUntil.Load() > now.UnixNano() }

// tryAcquire takes a concurrency slot (max 0: no cap).
func (st *depState) tryAcquire(max int64) bool {
	if n := st.inFlight.Add(1); max > 0 && n > max {
		st.inFlight.Add(-1)
		return false
	}
	return true
}

func (st *depState) release() { st.inFlight.Add(-1) }

// succeeded resets the failure count.
func (st *depState) succeeded() {
	st.mu.Lock()
	st.failures, st.backoff = 0, 0
	st.mu.Unlock()
}

// failed counts a connect failure or 5xx; it returns the ejection time
// when this failure ejects the deployment.
func (st *depState) failed(now time.Time) time.Duration {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.failures++
	if st.failures < ejectAfterFailures {
		return 0
	}
	st.failures = 0
	switch {
	case st.backoff == 0:
		st.backoff = ejectBase
	case st.backoff < ejectMax:
		st.backoff = min(2*st.backoff, ejectMax)
	}
	st.ejectedUntil.Store(now.Add(st.backoff).UnixNano())
	return st.backoff
}

// park takes the deployment out for d (capped at parkMax), as its
// Retry-After asked.
func (st *depState) park(now time.Time, d time.Duration) time.Duration {
	d = min(d, parkMax)
	until := now.Add(d).UnixNano()
	for {
		cur := st.ejectedUntil.Load()
		if cur >= until || st.ejectedUntil.CompareAndSwap(cur, until) {
			return d
		}
	}
}

// resolveGroup maps a requested model name to a model group: the key's
// alias map first, then the team's (SPEC §7.2). Names without an alias are
// group names.
func resolveGroup(p *catalog.Principal, requested string) string {
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
func allowedLevels(p *catalog.Principal, cu *configv1.Customer) [][]string {
	var out [][]string
	for _, l := range []*configv1.Limits{p.Key.GetLimits(), p.Team.GetLimits(), p.User.GetLimits(), p.Org.GetLimits(), cu.GetLimits()} {
		if m := l.GetAllowedModels(); len(m) > 0 {
			out = append(out, m)
		}
	}
	return out
}

// allowedDeployments filters deps to those every level permits: a level
// permits the whole group when it lists the group's name, else the
// deployments whose upstream model it lists. ok is false when nothing is
// permitted (an empty group counts as permitted when every level lists
// the group).
func allowedDeployments(p *catalog.Principal, cu *configv1.Customer, group string, deps []*catalog.Deployment) (out []*catalog.Deployment, ok bool) {
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

// candidate is a deployment that may serve the request.
type candidate struct {
	d  *catalog.Deployment
	st *depState
}

// capabilityFilter is one capability a request may need.
type capabilityFilter struct {
	param string
	need  func(*request) bool
	has   func(*configv1.Capabilities, *request) bool
	// what describes the need, for the error (formatted only then).
	what func(*request) string
}

// promptParam names the parameter carrying the prompt of a route.
func promptParam(route string) string {
	switch route {
	case RouteChat:
		return "messages"
	case RouteEmbeddings:
		return "input"
	}
	return "prompt"
}

// capabilityFilters are the filters in the order they apply. The param of
// the tools, prompt and max-tokens filters depends on the request
// (filterParam).
var capabilityFilters = [...]capabilityFilter{
	{"tools", func(r *request) bool { return r.tools },
		func(c *configv1.Capabilities, _ *request) bool { return c.GetTools() },
		func(*request) string { return "tool calling" }},
	{"response_format", func(r *request) bool { return r.jsonMode },
		func(c *configv1.Capabilities, _ *request) bool { return c.GetJsonMode() },
		func(*request) string { return "JSON mode (response_format)" }},
	{"messages", func(r *request) bool { return r.images },
		func(c *configv1.Capabilities, _ *request) bool { return c.GetVision() },
		func(*request) string { return "image input" }},
	{"prompt", func(r *request) bool { return r.promptEstimate > 0 },
		func(c *configv1.Capabilities, r *request) bool {
			return c.GetMaxInputTokens() == 0 || r.promptEstimate <= c.GetMaxInputTokens()
		},
		func(r *request) string { return fmt.Sprintf("a prompt of about %d tokens", r.promptEstimate) }},
	{"max_tokens", func(r *request) bool { return r.maxTokens > 0 },
		func(c *configv1.Capabilities, r *request) bool {
			return c.GetMaxOutputTokens() == 0 || r.maxTokens <= c.GetMaxOutputTokens()
		},
		func(r *request) string { return fmt.Sprintf("%s=%d", r.maxTokensParam, r.maxTokens) }},
}

// filterParam names the parameter a filter reports for this request.
func filterParam(f *capabilityFilter, route string, req *request) string {
	switch f.param {
	case "tools":
		if req.value("tools") == nil {
			return "functions"
		}
	case "prompt":
		return promptParam(route)
	case "max_tokens":
		return req.maxTokensParam
	}
	return f.param
}

// candidates returns the deployments that may serve req, in the order to
// try them: capability filters (none left: 400 unsupported_parameter
// naming the parameter), deployments whose credential cannot be decrypted
// removed (reported), the key's tag pool, health, then a weighted shuffle.
func (h *Handler) candidates(route string, req *request, p *catalog.Principal, group string, deps []*catalog.Deployment) ([]candidate, *Error) {
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
			return nil, invalidRequest(CodeUnsupportedParameter, filterParam(f, route, req),
				fmt.Sprintf("no deployment of model %q supports %s", group, f.what(req)))
		}
		deps = keep
	}
	usable := make([]*catalog.Deployment, 0, len(deps))
	for _, d := range deps {
		if d.CredentialErr != nil {
			h.reportCredentialError(d)
			continue
		}
		usable = append(usable, d)
	}
	if len(usable) == 0 {
		return nil, unavailable(CodeNoHealthyDeployment,
			fmt.Sprintf("model %q has no usable deployment right now", group), 5*time.Second)
	}
	usable = tagPool(usable, p.Key.GetTags())
	now := time.Now()
	cands := make([]candidate, 0, len(usable))
	for _, d := range usable {
		if st := h.states.get(d.GetId()); !st.ejected(now) {
			cands = append(cands, candidate{d, st})
		}
	}
	if len(cands) == 0 { // every one ejected: try them all rather than none
		for _, d := range usable {
			cands = append(cands, candidate{d, h.states.get(d.GetId())})
		}
	}
	weightedShuffle(cands)
	return cands, nil
}

// reportCredentialError logs a deployment's credential error once per
// distinct error and counts every request that found it unusable.
func (h *Handler) reportCredentialError(d *catalog.Deployment) {
	h.m.credentialErrors.WithLabelValues(d.GetId()).Inc()
	msg := d.CredentialErr.Error()
	st := h.states.get(d.GetId())
	if old := st.credErr.Load(); old != nil && *old == msg {
		return
	}
	if old := st.credErr.Swap(&msg); old != nil && *old == msg {
		return // another request logged it meanwhile
	}
	h.log.Error("deployment unavailable: its upstream credential cannot be decrypted",
		"deployment", d.GetId(), "model_group", d.GetModelGroup(), "error", msg)
}

// tagPool picks the deployments of the key's tag pool: those carrying one
// of the key's tags if any does; else the untagged ones (the default
// pool); else all.
func tagPool(deps []*catalog.Deployment, tags []string) []*catalog.Deployment {
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

// weightedShuffle orders cands by weighted sampling without replacement
// (Efraimidis–Spirakis: sort by u^(1/w) descending), so the first is
// picked with probability weight/total and retries follow the same law.
func weightedShuffle(cands []candidate) {
	if len(cands) < 2 {
		return
	}
	keys := make([]float64, len(cands))
	for i, c := range cands {
		w := float64(max(c.d.GetWeight(), 1))
		keys[i] = math.Pow(rand.Float64(), 1/w)
	}
	idx := make([]int, len(cands))
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
	out := make([]candidate, len(cands))
	for i, j := range idx {
		out[i] = cands[j]
	}
	copy(cands, out)
}
