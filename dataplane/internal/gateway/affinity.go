package gateway

import (
	"cmp"
	"context"
	"net/http"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
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
	// turn is the session's last turn (its pin's turn record): what the
	// deployment that served it holds in its prefix cache (prefill.go).
	turn affinity.Turn
	// looked is set once the lookup's answer was taken (look).
	looked bool
	look   affinityLookup
	// prefillIDs are the deployments whose prefill in flight the lookup
	// reads, in the order of its answer's Prefill.
	prefillIDs []string
	// sessionIDs are the deployments whose live sessions the lookup
	// reads (a request with a session), in the order of its answer's
	// Sessions.
	sessionIDs []string
	// placing: the request is a new session (no pin, or a pin to a gone
	// deployment) placed on the live sessions; placed is the deployment
	// its placement was counted on (placeSession: the deployment of its
	// latest attempt).
	placing bool
	placed  string
	// member is the candidate a new session already counts on (bySessions:
	// its earlier turn placed it there, or its pin's write was not read
	// yet), ordered first; "": none.
	member string
	// placeWrite is closed once the placement write in flight is done
	// (nil: none in flight).
	placeWrite chan struct{}
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
		if x.prefillOrdered() {
			x.startLoadLookup(ctx, cands) // interactive: placed by prefill in flight (prefill.go)
		}
		return // otherwise no key: shuffled, no Redis command
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
	k := affinity.Keys{Pin: a.pinKey, Loads: loadKeys}
	if a.pinKey != "" && len(cands) > 1 {
		// A new session is placed on the live sessions per deployment:
		// read with the pin, so known whatever the pin turns out to be.
		k.Sessions = make([]string, len(cands))
		a.sessionIDs = make([]string, len(cands))
		for i, c := range cands {
			a.sessionIDs[i] = c.d.GetId()
			k.Sessions[i] = store.SessionsKey(c.d.GetId())
		}
	}
	if x.prefillOrdered() && len(loadKeys) > 0 {
		k.Prefill, a.prefillIDs = prefillKeys(x.h.cfg.Limiter, cands)
		k.PrefillField = limits.PrefillField
	}
	a.lookup = make(chan affinityLookup, 1)
	go func() {
		res, err := store.LookupKeys(ctx, k, time.Now())
		a.lookup <- affinityLookup{res, err}
	}()
}

// awaitLookup returns the lookup's answer (zero when none was sent),
// waiting for it the first time; fresh is set on that first call.
func (x *exchange) awaitLookup() (look affinityLookup, fresh bool) {
	a := &x.aff
	if a.lookup == nil || a.looked {
		return a.look, false
	}
	a.look, a.looked = <-a.lookup, true
	return a.look, true
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
	out := x.orderByStrategy(cat, cands)
	// A session on its pin stays there: its engine holds the
	// conversation's prefix, which the prefill estimate of a busy engine
	// does not outweigh (docs/traffic.md, "Prefill in flight"). So does a
	// session on the deployment it already counts on without a pin read
	// (its previous turn's pin not written yet): moved by prefill, its pin
	// would then be written there, moving the session for good.
	if !x.prefillOrdered() || len(out) < 2 || x.aff.reason == reasonSession || x.aff.member != "" && out[0].d.GetId() == x.aff.member {
		return out
	}
	look, fresh := x.awaitLookup()
	if fresh && look.err != nil {
		x.h.em.loadLookups.WithLabelValues("error").Inc() // placed on this proxy's own counts
	}
	out = x.orderByPrefill(out, look.res)
	if id := out[0].d.GetId(); id != x.aff.first {
		x.aff.first, x.aff.reason = id, reasonPrefill
	}
	return out
}

// orderByStrategy orders cands by the group's strategy.
func (x *exchange) orderByStrategy(cat *catalog.Catalog, cands []candidate) []candidate {
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
	look, _ := x.awaitLookup()
	if a.lookup != nil {
		// A failed or timed-out lookup degrades to what this proxy knows:
		// the rendezvous order of the session or prefix over its own
		// loads (each candidate's, never a mix with the fleet-wide counts
		// that did arrive), like a new session; a pin that was not read is
		// unknown and kept (settleAffinity writes nothing over it).
		// Counted once per request in settleAffinity (outcome error).
		a.lookupFailed = look.err != nil
		a.pinUnknown = a.pinKey != "" && !look.res.PinRead
	}
	a.turn = look.res.Turn
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
	if pinAt < 0 && a.session != "" && !a.pinUnknown && (a.pinned == "" || a.pinGone) {
		out = x.bySessions(out, loaded, look.res)
	}
	switch {
	case pinAt >= 0:
	case a.session != "":
		a.reason = reasonLoad // a new session (or its pin unusable): placed by live sessions, or by rendezvous with bounded load
	case overloaded:
		a.reason = reasonLoad
	default:
		a.reason = reasonPrefix
	}
	a.first = out[0].d.GetId()
	return out
}

// bySessions orders a new session's candidates (out, in rendezvous order
// of the session) by their live sessions per unit of weight, then their
// in-flight requests per unit of weight (loaded, in the order of the
// candidates given to orderByStrategy), keeping the rendezvous order
// between equals, except that a candidate the session already counts on
// comes first (its first turn still runs there, or its pin's write has
// not been read yet: a concurrent or quick next turn must not move it): new sessions spread evenly over the fleet whatever
// their sessions' timing (a session between turns has nothing in flight
// but comes back). Only when the lookup answered every session count;
// otherwise out is kept (rendezvous with bounded load on the loads).
func (x *exchange) bySessions(out []candidate, loaded []routing.Loaded, res affinity.Lookup) []candidate {
	a := &x.aff
	if !res.SessionsComplete() || len(res.Sessions) != len(a.sessionIDs) {
		return out
	}
	sess := make(map[string]int64, len(a.sessionIDs))
	member := ""
	for i, id := range a.sessionIDs {
		sess[id] = res.Sessions[i]
		if i < len(res.Member) && res.Member[i] && member == "" {
			member = id
		}
	}
	load := make(map[string]int64, len(loaded))
	for _, l := range loaded {
		load[l.ID] = max(l.Load, 0)
	}
	for _, c := range out {
		if _, ok := sess[c.d.GetId()]; !ok {
			return out // a candidate the lookup did not ask about
		}
	}
	a.placing, a.member = true, member
	slices.SortStableFunc(out, func(p, q candidate) int {
		// The session already counts there (placed while an earlier turn
		// ran, or pinned by a write this lookup did not see yet): it
		// stays.
		if pm, qm := p.d.GetId() == member, q.d.GetId() == member; pm != qm {
			if pm {
				return -1
			}
			return 1
		}
		wp, wq := int64(max(p.d.GetWeight(), 1)), int64(max(q.d.GetWeight(), 1))
		if c := cmp.Compare(sess[p.d.GetId()]*wq, sess[q.d.GetId()]*wp); c != 0 {
			return c
		}
		return cmp.Compare(load[p.d.GetId()]*wq, load[q.d.GetId()]*wp)
	})
	return out
}

// placeSession counts a new session on dep, the deployment an attempt
// was just given, while its turn runs, so that the sessions placed after
// it see it before its pin is written, and so that the session's next
// turn, through any proxy, stays on dep though it reads no pin yet (the
// pin is written after the answer, off the request path): a placement
// made by an earlier attempt of the turn moves to dep. The write goes out
// beside the forward; awaitPlacement holds the answer until Redis took
// it. Not in Explain.
func (x *exchange) placeSession(dep string) {
	a := &x.aff
	store := x.h.cfg.Affinity
	// A session whose pin could not be read is counted where it went
	// too (kept after the turn, no pin written): its next turn that reads
	// no pin stays there instead of being placed anew, maybe elsewhere.
	if !(a.placing || a.pinUnknown && a.pinKey != "") || store == nil || a.placed == dep {
		return
	}
	// One placement write at a time: an earlier attempt's must land
	// before this one moves it.
	if a.placeWrite != nil {
		<-a.placeWrite
	}
	var from string
	if a.placed != "" {
		from = store.SessionsKey(a.placed)
	}
	a.placed = dep
	done := make(chan struct{})
	a.placeWrite = done
	key, pinKey, log, id := store.SessionsKey(dep), a.pinKey, x.h.log, x.id
	go func() {
		defer close(done)
		if err := store.Place(context.Background(), key, pinKey, from, time.Now()); err != nil {
			log.Warn("session placement not counted", "request_id", id, "deployment", dep, "error", err)
		}
	}()
}

// awaitPlacement waits for the pending placement write (placeSession),
// bounded by the affinity call timeout. It runs before the first byte of
// a 2xx answer reaches the client: a client that has its answer and sends
// the session's next turn at once, through any proxy, finds the session
// counted where this turn went (without it, a next turn sent before the
// write landed was placed again, maybe elsewhere, and its pin then moved
// the session for good). The write was sent when the attempt started, so
// it has usually landed long before the engine answers. Not for a
// session whose lookup failed: its Redis is slow, the answer is not held.
func (x *exchange) awaitPlacement() {
	if done := x.aff.placeWrite; done != nil && !x.aff.pinUnknown {
		<-done
		x.aff.placeWrite = nil
	}
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
	if store != nil && a.placed != "" && (!ok || !write && !a.pinUnknown || a.pinKey == "") {
		// The new session's turn failed: it has no pin, and its
		// placement no longer counts. (A session whose pin was not read
		// keeps its placement: PlaceTTL at most.)
		key, pinKey, log, id, pending := store.SessionsKey(a.placed), a.pinKey, x.h.log, x.id, a.placeWrite
		go func() {
			if pending != nil {
				<-pending // withdrawn after it landed, not before
			}
			if err := store.Unplace(context.Background(), key, pinKey); err != nil {
				log.Warn("session placement not withdrawn", "request_id", id, "error", err)
			}
		}()
	}
	if !write || !ok || store == nil || a.pinKey == "" {
		return
	}
	key, ttl, log, id := a.pinKey, x.rt.sessionTTL, x.h.log, x.id
	// The session counts on the deployment that served it (its pin's
	// expiry), in the pin's call; a placement elsewhere is withdrawn.
	sw := affinity.SessionWrite{Sessions: store.SessionsKey(served)}
	if a.placed != "" {
		sw.Placed = store.SessionsKey(a.placed)
	}
	// The turn the deployment served is what its prefix cache holds for
	// the session's next turn (prefill.go, prefillEstimate).
	var turn *affinity.Turn
	if x.usageSeen && x.req != nil {
		turn = &affinity.Turn{Prompt: x.prompt, Completion: x.completion, Estimate: x.req.PromptEstimate()}
	}
	sw.Turn = turn
	go func() {
		if err := store.PinSession(context.Background(), key, served, ttl, sw, time.Now()); err != nil {
			log.Warn("session pin not written", "request_id", id, "deployment", served, "error", err)
		}
	}()
}
