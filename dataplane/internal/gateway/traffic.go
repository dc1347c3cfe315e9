package gateway

// traffic.go: the admission stage's traffic class (docs/traffic.md) and
// what follows from it: the response headers, the engine priority of the
// upstream body and the class scopes of a deployment's lease.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/admission"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/classify"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Response headers naming the class a request was admitted as and why.
const (
	HeaderTrafficClass = "X-Sluice-Traffic-Class"
	HeaderClassReason  = "X-Sluice-Class-Reason"
)

// classify resolves the exchange's traffic class from its credential, the
// org's compiled policy (rules, default, demotion) and this proxy's count
// of the key's interactive requests in flight, and announces it in the
// response headers.
func (x *exchange) classify(w http.ResponseWriter, cat *catalog.Catalog, hd http.Header) {
	h := x.h
	orgID := x.p.Key.GetOrgId()
	var pol *classify.Policy
	if tp := cat.TrafficPolicy(orgID); tp != nil {
		pol = tp.Policy
		if tp.FirstReport() {
			h.log.Error("the org's traffic settings do not compile: its classification rules are not applied (credential class, else the default class)",
				"org_id", orgID, "error", tp.Err)
		}
	}
	in := classify.Input{KeyClass: x.p.Key.GetTrafficClass(), TeamClass: x.p.Team.GetTrafficClass(), Header: hd}
	if x.req != nil {
		in.PromptTokens = x.req.PromptEstimate()
	}
	keyID := x.p.Key.GetId()
	counted := false
	if pol.Demotes() {
		// Counted first, uncounted unless admitted interactive: two
		// requests arriving together cannot both see the other missing.
		in.InteractiveInFlight = h.inFlight.Acquire(keyID)
		counted = true
	}
	res := pol.Classify(in)
	if counted && res.Class != configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE {
		h.inFlight.Release(keyID)
		counted = false
	}
	x.cat = cat
	x.classEnum, x.class, x.classReason, x.countedInteractive = res.Class, classify.Name(res.Class), res.Reason, counted
	w.Header().Set(HeaderTrafficClass, x.class)
	w.Header().Set(HeaderClassReason, x.classReason)
	h.classifiedSeries(x.class, x.classReason).Inc()
}

// releaseClass uncounts the exchange's interactive request (finish).
func (x *exchange) releaseClass() {
	if x.countedInteractive {
		x.countedInteractive = false
		x.h.inFlight.Release(x.p.Key.GetId())
	}
}

// UpstreamBody is the body sent to deployment d: the request rewritten
// for it, the client's "priority" removed, and the class's engine priority
// set when d runs priority scheduling (chat and completions; embeddings
// carry none). Client headers never reach the engine, X-Vllm-Priority
// included: the forwarder builds the upstream request's headers itself.
func (x *exchange) UpstreamBody(d *catalog.Deployment) []byte {
	if x.route != openai.RouteEmbeddings {
		if p, ok := classify.EnginePriority(d.GetTraffic(), x.classEnum); ok {
			return x.req.RewriteWithPriority(d.GetUpstreamModel(), &p)
		}
	}
	return x.req.Rewrite(d.GetUpstreamModel())
}

// deploymentScopes are the scopes of the exchange's fleet-wide lease on d:
// max_concurrency and, by class, the non-reserved share and the batch cap
// (admission.DeploymentScopes). ok is false when the class may not use d.
func (x *exchange) deploymentScopes(d *catalog.Deployment) ([]limits.Scope, bool) {
	return admission.DeploymentScopes(d.GetId(), d.GetMaxConcurrency(), d.GetTraffic(), x.classEnum)
}

// queue waits in the proxy's admission queue of the exchange's model
// group and class for a slot on any candidate (strict priority between
// classes; admission.Queues). nil, nil: no queue for this class (the
// caller answers 503 at once). A shed request is 503 overloaded with the
// queue's retry-after; its admission consumes nothing (settleLeases).
func (x *exchange) queue(ctx context.Context, cands []candidate, hint time.Duration) (*candidate, *openai.Error) {
	h := x.h
	deps := make([]*configv1.DeploymentTraffic, 0, len(cands))
	for _, c := range cands {
		if t := c.d.GetTraffic(); t != nil {
			deps = append(deps, t)
		}
	}
	var g *configv1.ModelGroup
	if x.cat != nil {
		g = x.cat.ModelGroup(x.group)
	}
	b := h.cfg.AdmissionQueues.Resolve(x.classEnum, g, deps)
	if b.MaxLength <= 0 {
		return nil, nil
	}
	var got *candidate
	var fail *openai.Error
	shed, err := h.queues.Wait(ctx, x.group, x.classEnum, x.fairTeam(), b, max(hint, 100*time.Millisecond), func() (bool, bool) {
		next, wait, recovering := 0, time.Duration(0), false
		got, fail = x.pick(ctx, cands, &next, &wait, &recovering)
		return got != nil, fail != nil
	})
	switch {
	case fail != nil:
		return nil, fail
	case err != nil:
		// The client left or the request's deadline passed while waiting.
		if errors.Is(context.Cause(ctx), errLeaseLost) {
			return nil, limitsUnavailable("the request's limits leases could not be renewed while it waited")
		}
		return nil, &openai.Error{Status: openai.StatusClientClosed, Type: openai.TypeServiceUnavailable, Code: openai.CodeClientClosed,
			Message: "the request ended while it waited for a slot"}
	case shed != nil:
		x.shed = true
		msg := fmt.Sprintf("every deployment of model %q is at its %s concurrency limit and the %s queue is full", x.group, x.class, x.class)
		if shed.Reason == admission.ShedTimeout {
			msg = fmt.Sprintf("no %s slot of model %q freed within the queue timeout (%s)", x.class, x.group, b.Timeout)
		}
		return nil, openai.Unavailable(openai.CodeOverloaded, msg, shed.RetryAfter)
	}
	return got, nil
}

// fairTeam is who the exchange's served cost counts for in its class's
// queue (vtc.go): its team, else its key (a key without a team).
func (x *exchange) fairTeam() string {
	if t := x.p.Key.GetTeamId(); t != "" {
		return t
	}
	return "key:" + x.p.Key.GetId()
}

// chargeServed counts the exchange's estimated prompt cost as served to
// its team once it takes its first slot; settleServed corrects it to the
// real cost (prompt and completion tokens) when the exchange ends.
func (x *exchange) chargeServed() {
	if x.charged || x.req == nil {
		return
	}
	x.charged, x.chargedCost = true, admission.Cost(x.req.PromptEstimate(), 0)
	x.h.queues.Charge(x.group, x.classEnum, x.fairTeam(), x.chargedCost)
}

func (x *exchange) settleServed() {
	if !x.charged {
		return
	}
	x.charged = false
	x.h.queues.Charge(x.group, x.classEnum, x.fairTeam(), admission.Cost(x.prompt, x.completion)-x.chargedCost)
}

// backlog serves GET /health/backlog: per class, this proxy's requests in
// flight at deployments, waiting and shed (no tenant names).
func (h *Handler) backlog(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(h.queues.Backlog())
}

// AdmissionBacklog is the backlog of GET /health/backlog for the
// heartbeat: one entry per traffic class, in priority order.
func (h *Handler) AdmissionBacklog() []*configv1.AdmissionBacklog {
	b := h.queues.Backlog()
	out := make([]*configv1.AdmissionBacklog, 0, len(admission.Classes))
	for _, c := range admission.Classes {
		name := classify.Name(c)
		cb := b.Classes[name]
		out = append(out, &configv1.AdmissionBacklog{TrafficClass: name, InFlight: cb.InFlight, Queued: cb.Queued, Shed: cb.Rejected})
	}
	return out
}
