package gateway

import (
	"context"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/routing"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Affinity (SPEC §7.2, docs/routing.md "Affinity"): the order of the
// filtered candidates. A request with a session goes first to the
// deployment its session is pinned to, when that deployment survived
// every filter (permissions, tag pool, capabilities, health); a new
// session, or a request without one whose prompt has a long prefix, goes
// to the rendezvous choice of its session id or prefix with bounded load
// (fleet-wide in-flight leases); anything else is shuffled by weight. The
// pin lookup and the loads are one pipelined Redis call run concurrently
// with the admission call (no sequential round trip); a request with
// neither session nor long prefix sends nothing.

// Routing reasons (the usage event's routing_reason, the access log).
const (
	reasonSession  = "session"
	reasonPrefix   = "prefix"
	reasonLoad     = "load"
	reasonShuffle  = "shuffle"
	reasonFallback = "fallback"
)

// affinityMetrics count affinity decisions.
type affinityMetrics struct {
	decisions *prometheus.CounterVec
}

func newAffinityMetrics(reg prometheus.Registerer) (*affinityMetrics, error) {
	m := &affinityMetrics{decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_proxy_affinity_total",
		Help: "Affinity decisions by kind (session, prefix) and outcome: hit (served where the session is pinned or the prefix hashes), " +
			"miss (a session without a pin), override (the pin or the prefix's replica was skipped: filtered out, ejected, full, above the load bound), " +
			"dropped (a pin to a deployment that no longer exists), error (the lookup failed or timed out: routed on this proxy's own loads, an unread pin kept; instead of the other outcomes).",
	}, []string{"kind", "outcome"})}
	if err := reg.Register(m.decisions); err != nil {
		return nil, err
	}
	return m, nil
}

// affinityState is what an exchange knows of its affinity.
type affinityState struct {
	session string
	pinKey  string
	prefix  uint64
	// hasKey: the request has a session or a long prefix.
	hasKey bool
	// lookup is the pending Redis lookup (nil: none was sent).
	lookup chan affinityLookup
	// pinned is the deployment the session is pinned to ("": none).
	pinned string
	// lookupFailed: the lookup failed or timed out (wholly or in part);
	// pinUnknown: the session's pin in particular was not read, so it may
	// exist and must not be overwritten.
	lookupFailed, pinUnknown bool
	// pinGone: pinned names a deployment the group no longer has.
	pinGone bool
	// first is the deployment ordered first, reason why.
	first, reason string
}

type affinityLookup struct {
	res affinity.Lookup
	err error
}

// startAffinity starts the affinity lookup of the request, when it has a
// session or a long prefix and more than one candidate.
func (x *exchange) startAffinity(ctx context.Context, hd http.Header, cands []candidate) {
	a := &x.aff
	a.session, _ = affinity.SessionID(hd)
	var g *configv1.ModelGroup
	if x.cat != nil {
		g = x.cat.ModelGroup(x.group)
	}
	x.rt = routingOf(g, x.classEnum, a.session != "")
	switch {
	case x.rt.loadAware():
		x.startLoadLookup(ctx, cands)
		return
	case x.rt.strategy == strategyWeightedShuffle:
		return // no key: shuffled, no Redis command
	}
	if a.session == "" {
		a.prefix, a.hasKey = routing.PrefixKey(x.route, x.req)
	} else {
		a.prefix, a.hasKey = sessionKey(a.session), true
	}
	store := x.h.cfg.Affinity
	if !a.hasKey || store == nil || (len(cands) < 2 && a.session == "") {
		return
	}
	if a.session != "" {
		a.pinKey = store.PinKey(x.p.Key.GetOrgId(), x.group, a.session)
	}
	var loadKeys []string
	if lim := x.h.cfg.Limiter; lim != nil && len(cands) > 1 {
		loadKeys = make([]string, len(cands))
		for i, c := range cands {
			if c.d.GetMaxConcurrency() > 0 {
				loadKeys[i] = lim.DeploymentLeaseKey(c.d.GetId())
			}
		}
		loadKeys = compactKeys(loadKeys)
	}
	if a.pinKey == "" && len(loadKeys) == 0 {
		return // nothing to read: rendezvous on local loads
	}
	a.lookup = make(chan affinityLookup, 1)
	go func() {
		res, err := store.Lookup(ctx, a.pinKey, loadKeys, time.Now())
		a.lookup <- affinityLookup{res, err}
	}()
}

// compactKeys drops empty keys (deployments without max_concurrency have
// no leases), keeping order; orderCandidates matches them back by key.
func compactKeys(keys []string) []string {
	out := keys[:0]
	for _, k := range keys {
		if k != "" {
			out = append(out, k)
		}
	}
	return out
}

// sessionKey is the rendezvous key of a session without a pin.
func sessionKey(session string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(session); i++ {
		h ^= uint64(session[i])
		h *= 1099511628211
	}
	return h
}

// orderCandidates orders cands (already shuffled by weight) for the
// request: the session's pin first when it is a candidate, then the
// rendezvous order of the session or prefix with bounded load.
func (x *exchange) orderCandidates(cat *catalog.Catalog, cands []candidate) []candidate {
	a := &x.aff
	if x.rt.loadAware() {
		return x.orderByLoad(cands)
	}
	if !a.hasKey || len(cands) == 0 {
		a.reason = reasonShuffle
		if len(cands) > 0 {
			a.first = cands[0].d.GetId()
		}
		return cands
	}
	var look affinityLookup
	if a.lookup != nil {
		look = <-a.lookup
		// A failed or timed-out lookup degrades to what this proxy knows:
		// the rendezvous order of the session or prefix over its own
		// loads (each candidate's, never a mix with the fleet-wide counts
		// that did arrive), like a new session; a pin that was not read is
		// unknown and kept (settleAffinity writes nothing over it).
		// Counted once per request in settleAffinity (outcome error).
		a.lookupFailed = look.err != nil
		a.pinUnknown = a.pinKey != "" && !look.res.PinRead
	}
	// Loads: fleet-wide lease counts when all are known, else this
	// instance's.
	loaded := x.loadedOf(cands, look)
	order, overloaded := routing.BoundedRendezvous(a.prefix, loaded, x.rt.loadFactor)
	out := make([]candidate, 0, len(cands))
	a.pinned = look.res.Pinned
	pinAt := -1
	if a.pinned != "" {
		for i, c := range cands {
			if c.d.GetId() == a.pinned {
				pinAt = i
			}
		}
		if pinAt < 0 {
			a.pinGone = !groupHas(cat, x.group, a.pinned)
		}
	}
	if pinAt >= 0 {
		out = append(out, cands[pinAt])
		a.reason = reasonSession
	}
	for _, i := range order {
		if i != pinAt {
			out = append(out, cands[i])
		}
	}
	switch {
	case pinAt >= 0:
	case a.session != "":
		a.reason = reasonLoad // a new session (or its pin unusable): placed by rendezvous with bounded load
	case overloaded:
		a.reason = reasonLoad
	default:
		a.reason = reasonPrefix
	}
	a.first = out[0].d.GetId()
	return out
}

func groupHas(cat *catalog.Catalog, group, id string) bool {
	for _, d := range cat.Deployments(group) {
		if d.GetId() == id {
			return true
		}
	}
	return false
}

func (x *exchange) affKind() string {
	if x.aff.session != "" {
		return "session"
	}
	return "prefix"
}

// routingReason is why x.dep served the request.
func (x *exchange) routingReason() string {
	if x.dep == nil {
		return ""
	}
	if x.dep.GetId() != x.aff.first || x.dep.GetModelGroup() != x.group {
		return reasonFallback
	}
	return x.aff.reason
}

// settleAffinity counts the decision and pins or refreshes the session's
// pin once a deployment served it (off the request path). A pin to a
// deployment that was skipped (filtered out, ejected, full) is kept for
// the session's return; a pin to one that no longer exists is replaced;
// a pin that could not be read (the lookup failed or timed out) is left
// as it is. A failed lookup counts as outcome error, once.
func (x *exchange) settleAffinity() {
	a := &x.aff
	if !a.hasKey || x.dep == nil {
		return
	}
	served := x.dep.GetId()
	ok := x.status > 0 && x.status < 400
	outcome, write := "", false
	switch {
	case a.session == "":
		switch {
		case !ok:
		case served == a.first && a.reason == reasonPrefix:
			outcome = "hit"
		default:
			outcome = "override"
		}
	case a.pinUnknown:
		// The session may be pinned elsewhere: writing a pin to where
		// this request went would move it for good.
	case a.pinned == served:
		outcome, write = "hit", true
	case a.pinned == "":
		outcome, write = "miss", true
	case a.pinGone:
		outcome, write = "dropped", true
	default:
		outcome = "override" // the pin is kept for the session's return
	}
	if a.lookupFailed {
		outcome = "error"
	}
	if outcome != "" {
		x.h.affm.decisions.WithLabelValues(x.affKind(), outcome).Inc()
	}
	store := x.h.cfg.Affinity
	if !write || !ok || store == nil || a.pinKey == "" {
		return
	}
	key, ttl, log, id := a.pinKey, x.rt.sessionTTL, x.h.log, x.id
	go func() {
		if err := store.Pin(context.Background(), key, served, ttl); err != nil {
			log.Warn("session pin not written", "request_id", id, "deployment", served, "error", err)
		}
	}()
}
