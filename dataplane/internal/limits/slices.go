package limits

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"math"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	"github.com/sluicegw/sluice/internal/budget"
)

// Quota slices (issue 15; docs/limits.md, "Quota slices").
//
// For a hot scope with large limits, a data plane holds slices of the
// fleet-wide limits, carved in Redis by carve.lua, and admits against them
// locally, without a round trip:
//
//   - rpm/tpm: requests and tokens added to one bucket of the scope's window
//     as if admitted there, usable until that bucket ends (by Redis's clock,
//     measured conservatively from when the carve was sent). A unit counted
//     in bucket b stays counted until b leaves the window, at least one full
//     window after any use within b, so the window's overshoot bound stays
//     zero. The slices of a bucket are held under a rate lease (carve.lua's
//     'ql' entry: what they put in the bucket, watermarks): requests use
//     them only below the watermarks Redis holds, so one bucket after b
//     ends, whether this data plane lives or not, the next carve of the
//     scope or a sweeper gives back all but the watermarks' worth of what
//     it did not return itself.
//   - budget: micro-dollars added to the spend of the scope's current budget
//     window ('bs') as one reservation, usable for BudgetLife (and never past
//     the window's end). Requests reserve their maximum cost in the slice;
//     settlement replaces it by the real cost locally, and the worker gives
//     back what was not spent. Whatever a slice holds is counted in Redis
//     from the carve on, so the fleet's spend never exceeds what exact
//     admission allows.
//     The slices of a scope are held under a budget lease (carve.lua's
//     'bh' entry: what they put in the spend, a watermark, an expiry):
//     requests take from them only below the watermark Redis holds, so
//     when a dead data plane's lease expires the next carve of the scope
//     gives back all but the watermark's worth.
//   - concurrency: lease members of this data plane in the scope's lease set
//     ("<instance>:<n>"), scored by their lease expiry like any request's
//     lease, renewed by the worker every RenewInterval and removed when given
//     back. A member is used by one request at a time, so the fleet's count
//     stays exact; a dead data plane's members expire with the lease TTL.
//
// Slices are used only while Redis answers (live): a data plane whose
// calls went unanswered for a tick plus the call timeout, or whose
// connection broke, admits exactly, and so fails closed as without slices.
//
// What slices did not use, refunds and debts are returned by the slice
// worker (RunSlices), in the same carve.lua call that carves the next
// slices and renews the leases: one call per org, for all of its scopes,
// every SliceConfig.Tick (when there is anything to send). Carves take at
// most 1/Share of the room left below the limit less its reserve, so near
// the limit slices shrink, then stop, and the scope is admitted exactly
// (admit.lua) again; scopes whose limits are below the Min* settings never
// leave exact admission. Each kind of limit of a scope is sliced on its
// own: a request's rpm may come from slices while its budget goes to
// Redis in the one exact admission call.

// Defaults of SliceConfig.
const (
	DefaultSliceMinRPM      = 600
	DefaultSliceMinTPM      = 60_000
	DefaultSliceMinParallel = 20
	DefaultSliceMinBudget   = 1_000_000 // micro-USD: $1
	DefaultSliceReserve     = 100       // per mille
	DefaultSliceShare       = 4
	DefaultSliceTick        = 50 * time.Millisecond
	DefaultSliceIdle        = 10 * time.Second
	DefaultSliceLinger      = 500 * time.Millisecond
	DefaultSliceBudgetLife  = 2 * time.Second
	sliceDeadlineMargin     = 5 * time.Millisecond
	maxSliceItemsPerCall    = 128
)

// SliceConfig configures quota slices; the zero value disables them.
type SliceConfig struct {
	// Enabled turns slices on.
	Enabled bool
	// MinRPM and MinTPM: a scope whose rpm (tpm) limit is below is always
	// admitted exactly.
	MinRPM, MinTPM int64
	// MinParallel: a scope whose max_parallel_requests is below is always
	// admitted exactly.
	MinParallel int64
	// MinBudgetMicros: a budget whose cap is below (or a soft budget
	// alone) is always admitted exactly.
	MinBudgetMicros int64
	// Reserve is the part of each limit, per mille, that is never carved:
	// the last requests of a window (the last dollars of a budget, the last
	// slots of a concurrency cap; at least one) are admitted exactly.
	Reserve int64
	// Share: one carve takes at most 1/Share of the room left.
	Share int64
	// Tick is the slice worker's period (returns, refills).
	Tick time.Duration
	// Idle: a scope without demand for this long is forgotten.
	Idle time.Duration
	// Linger: a scope without demand for this long gives back its free
	// budget and concurrency slices.
	Linger time.Duration
	// BudgetLife is how long a budget slice may be used after its carve.
	BudgetLife time.Duration
	// Instance names this data plane's concurrency slots in Redis; empty:
	// random. It must be unique in the fleet.
	Instance string
}

func (c *SliceConfig) defaults() {
	def := func(p *int64, v int64) {
		if *p == 0 {
			*p = v
		}
	}
	def(&c.MinRPM, DefaultSliceMinRPM)
	def(&c.MinTPM, DefaultSliceMinTPM)
	def(&c.MinParallel, DefaultSliceMinParallel)
	def(&c.MinBudgetMicros, DefaultSliceMinBudget)
	def(&c.Reserve, DefaultSliceReserve)
	def(&c.Share, DefaultSliceShare)
	dur := func(p *time.Duration, v time.Duration) {
		if *p == 0 {
			*p = v
		}
	}
	dur(&c.Tick, DefaultSliceTick)
	dur(&c.Idle, DefaultSliceIdle)
	dur(&c.Linger, DefaultSliceLinger)
	dur(&c.BudgetLife, DefaultSliceBudgetLife)
	if c.Instance == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		c.Instance = hex.EncodeToString(b[:])
	}
}

type sliceKey struct{ org, kind, id string }

// slice is one rate carve held: units left of bucket, usable until
// deadline. gR/gT and wR/wT are this data plane's rate lease of the bucket
// as Redis held it at the last call (carve.lua's 'ql' entry): what its
// slices put in the bucket and did not give back, and the watermarks. A
// take keeps what was used (g - left) within the watermark, so a data plane
// that dies leaves only the watermarks' worth of its unused units counted.
type slice struct {
	bucket         int64
	deadline       time.Time
	r, t           int64
	gR, gT, wR, wT int64
}

// rlRaise asks Redis to raise the watermarks of the rate lease of a bucket.
type rlRaise struct{ bucket, r, t int64 }

// sliceRet is what goes back to one bucket: unused requests and tokens
// (t < 0: a debt to charge).
type sliceRet struct{ r, t int64 }

// bslice is one budget carve held: free micro-USD of budget window widx
// (of the org's epoch), usable until deadline.
type bslice struct {
	widx, epoch int64
	deadline    time.Time
	free        int64
}

// bretKey names where a budget return goes: a window of an epoch (a
// return into a state Redis lost would free what the reseeded window
// never counted, so carve.lua drops returns of another epoch).
type bretKey struct{ widx, epoch int64 }

// sliceScope is the local state of one scope.
type sliceScope struct {
	owner *slicer
	key   sliceKey
	// gone is set when the scope leaves its slicer's map (idle): a Scope
	// slot that remembers it looks it up again.
	gone  atomic.Bool
	hkey  string
	pkey  string
	scope ScopeRef

	mu       sync.Mutex
	rpm, tpm int64  // the limits the held slices were carved under
	gen      uint64 // bumped when the limits change
	held     []slice
	rets     map[int64]sliceRet // refunds of used units and debts (always applied)
	frets    map[int64]sliceRet // units slices did not use (applied while the lease holds them)
	maxT     int64              // largest token estimate seen (decays)
	usedR    int64              // demand since the last tick (local and exact)
	usedT    int64
	rateR    float64 // demand per second (moving average)
	rateT    float64
	lastUse  time.Time
	inflight bool
	backoff  time.Time // no rate carve before (the last one got nothing)
	// Header state from the last carve: the fleet's remaining outside the
	// slices and the reset times, as of carvedAt.
	remR, remT     int64
	resetR, resetT time.Duration
	carvedAt       time.Time
	epoch          int64 // the org's epoch at the last carve (0: none yet)

	// Budget slices.
	bud      *Budget // the budget the slices were carved under (nil: none)
	bunit    budget.Unit
	bgen     uint64
	bheld    []bslice
	brets    map[bretKey]int64 // > 0: unused, back to the window; < 0: a debt
	usedB    int64             // micro-USD reserved since the last tick
	maxB     int64             // largest reservation seen (decays)
	rateB    float64
	bbackoff time.Time
	alerts   []BudgetAlert // crossed by carves, for the next settlement (no OnCarveAlerts sink)
	// The budget lease (carve.lua's 'bh' entry of this data plane): bN is
	// what requests took from the slices and did not give back, bB the
	// watermark Redis holds (bN never exceeds it: a take that would waits
	// for a call raising it), bsent when the last call renewing the lease
	// was sent (slices are not used once the lease may have expired).
	bN, bB int64
	bsent  time.Time

	// Concurrency slices: members of the scope's lease set.
	par      int64 // the limit the members were carved under
	pgen     uint64
	pfree    []string            // members held and free
	pall     map[string]struct{} // members held (free or in use)
	pgone    []string            // members to remove from Redis
	puse     int64               // members in use
	pexact   int64               // requests in flight admitted exactly (no free member)
	pseq     int64               // members named so far
	psent    time.Time           // when the last renewal of every member was sent (answered)
	plost    bool                // renewals failed for too long: members unusable
	pdemand  int64               // peak demand since the last tick
	ppeak    float64             // decaying peak demand
	pbackoff time.Time
	lastPar  time.Time // last concurrency demand
	lastBud  time.Time // last budget demand
}

// Kinds of limits a sliceTake holds (bits of sliceTake.kinds).
const (
	takeRate uint8 = 1 << iota
	takeBudget
	takePar
)

// sliceTake is what a request took from the slices of one scope: one per
// scope, with a bit per kind taken (kinds), so that a request limited by
// every kind at key, team and org level makes three.
type sliceTake struct {
	sc *sliceScope
	// rate: the slice's bucket, the request (0 or 1) and its tokens
	bucket, r, t int64
	// budget: the reservation, its window and epoch, and the generation
	// of the scope's budget slices it was taken under
	cost, widx, epoch int64
	bgen              uint64
	// concurrency: the member, and the generation it was taken under
	member string
	pgen   uint64
	kinds  uint8
	hasTPM bool
}

// has reports whether the take holds a limit of kind k.
func (tk *sliceTake) has(k uint8) bool { return tk.kinds&k != 0 }

// slicer holds the slices of one Limiter.
type slicer struct {
	lim *Limiter
	cfg SliceConfig
	mu  sync.RWMutex
	m   map[sliceKey]*sliceScope
	// idx mirrors m (written under mu) for the requests' lookups, which
	// take no lock: a read-mostly sync.Map of stable keys writes nothing
	// shared, where RLock would bounce mu's reader count between cores
	// three times per request.
	idx sync.Map // sliceKey → *sliceScope
	// calls counts the worker's carve.lua calls (tests, benchmarks).
	calls atomic.Int64
	now   func() time.Time
	// Redis liveness (fail closed, as exact admission does): slices are
	// used only while a call sent less than liveWindow ago was answered
	// (aliveSent, unix ns) and no connection error was seen since it was
	// sent (lostAt). Every call of the limiter counts (liveStore); the
	// worker pings Redis every tick when it sends nothing else.
	aliveSent atomic.Int64
	lostAt    atomic.Int64
	pings     atomic.Int64
	held      atomic.Bool // the slicer holds scopes (heartbeats needed)
	// wake kicks the worker when a request found no slice (at most one
	// early tick per Tick/5); lastTick is when the last tick ran.
	wake     chan struct{}
	tmu      sync.Mutex
	lastTick time.Time
	// running: RunSlices is running; flush asks it to give every slice
	// back (ReturnSlices) and is closed-over done when it has.
	running atomic.Bool
	flush   chan chan struct{}
}

// kick asks the worker for an early tick: a request found no usable
// slice, so the carve for it need not wait for the next Tick.
func (s *slicer) kick() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// liveWindow is how long an answered call keeps slices usable: one tick
// (the heartbeat's period) plus the call timeout (what exact admission
// waits before it fails closed).
func (s *slicer) liveWindow() time.Duration { return s.cfg.Tick + s.lim.cfg.CallTimeout }

// live reports whether Redis answered recently enough for slices to be
// used at now.
func (s *slicer) live(now time.Time) bool {
	a := s.aliveSent.Load()
	return a > s.lostAt.Load() && now.UnixNano() < a+int64(s.liveWindow())
}

// observe records the outcome of a call sent at sent: an answer (a reply,
// even an error reply) proves Redis alive; a broken or refused connection
// stops the use of slices at once. A timeout changes nothing: slices stop
// when no answer came for liveWindow.
func (s *slicer) observe(sent time.Time, err error) {
	if err == nil || replyError(err) {
		t := sent.UnixNano()
		for {
			a := s.aliveSent.Load()
			if a >= t || s.aliveSent.CompareAndSwap(a, t) {
				return
			}
		}
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return
	}
	s.lostAt.Store(s.now().UnixNano())
}

// replyError reports whether err is an error reply of Redis.
func replyError(err error) bool {
	var pe redispipe.Error
	if errors.As(err, &pe) {
		return true
	}
	var re redis.Error
	return errors.As(err, &re)
}

// liveStore is the limiter's store with slices on: it feeds every call's
// outcome to the slicer's liveness.
type liveStore struct {
	store
	s *slicer
}

func (w liveStore) eval(ctx context.Context, sc *script, c scriptCall) ([]int64, error) {
	sent := w.s.now()
	v, err := w.store.eval(ctx, sc, c)
	w.s.observe(sent, err)
	return v, err
}

func (w liveStore) evalBatch(ctx context.Context, sc *script, calls []scriptCall) ([][]int64, []error) {
	sent := w.s.now()
	v, errs := w.store.evalBatch(ctx, sc, calls)
	for _, err := range errs {
		if err == nil {
			w.s.observe(sent, nil)
			break
		}
	}
	for _, err := range errs {
		if err != nil {
			w.s.observe(sent, err)
		}
	}
	return v, errs
}

func (w liveStore) ping(ctx context.Context) error {
	sent := w.s.now()
	err := w.store.ping(ctx)
	w.s.observe(sent, err)
	return err
}

func (w liveStore) setNX(ctx context.Context, key string, v int64) error {
	sent := w.s.now()
	err := w.store.setNX(ctx, key, v)
	w.s.observe(sent, err)
	return err
}

// expired and mget are the sweeper's reads (sweepStore) of the wrapped
// store. Without them a limiter with slices on could not sweep: every
// data plane's sweeper failed with "the limits store cannot sweep", so a
// killed proxy's requests were never swept and budget leases never
// reclaimed by a sweeper.
func (w liveStore) expired(ctx context.Context, keys []string, maxScore int64, limit int) ([][]string, []error) {
	ss, ok := w.store.(sweepStore)
	if !ok {
		errs := make([]error, len(keys))
		for i := range errs {
			errs[i] = errors.New("the limits store cannot sweep")
		}
		return make([][]string, len(keys)), errs
	}
	sent := w.s.now()
	v, errs := ss.expired(ctx, keys, maxScore, limit)
	for _, err := range errs {
		w.s.observe(sent, err)
	}
	return v, errs
}

func (w liveStore) mget(ctx context.Context, groups [][]string) ([][]string, []error) {
	ss, ok := w.store.(sweepStore)
	if !ok {
		errs := make([]error, len(groups))
		for i := range errs {
			errs[i] = errors.New("the limits store cannot sweep")
		}
		return make([][]string, len(groups)), errs
	}
	sent := w.s.now()
	v, errs := ss.mget(ctx, groups)
	for _, err := range errs {
		w.s.observe(sent, err)
	}
	return v, errs
}

func newSlicer(l *Limiter, cfg SliceConfig) *slicer {
	cfg.defaults()
	return &slicer{lim: l, cfg: cfg, m: map[sliceKey]*sliceScope{}, now: time.Now, wake: make(chan struct{}, 1),
		flush: make(chan chan struct{})}
}

// rateOK reports whether a scope's rate limits may be sliced.
func (s *slicer) rateOK(sc *Scope) bool {
	if sc.RPM == 0 && sc.TPM == 0 {
		return false
	}
	return (sc.RPM == 0 || sc.RPM >= s.cfg.MinRPM) && (sc.TPM == 0 || sc.TPM >= s.cfg.MinTPM)
}

// budgetOK reports whether a scope's budget may be sliced.
func (s *slicer) budgetOK(sc *Scope) bool {
	return sc.Budget != nil && sc.Budget.CapMicros >= s.cfg.MinBudgetMicros
}

// parOK reports whether a scope's concurrency limit may be sliced. A
// deployment's lease set (its max_concurrency and class caps) stays
// exact: routing reads it fleet-wide as the deployment's load
// (least_outstanding, engine_load, bounded-load affinity), the prefill in
// flight is accounted in its lease calls, and slots a proxy held unused
// would count as load there.
func (s *slicer) parOK(sc *Scope) bool {
	return sc.Kind != KindDeployment && sc.MaxParallel >= s.cfg.MinParallel
}

// sliceSlot is a Scope's memory of its quota slices (Scope.slot): the
// sliceScope found last, used while it is still in its slicer's map.
type sliceSlot struct {
	st atomic.Pointer[sliceScope]
}

func (s *slicer) lookup(org string, sc *Scope) *sliceScope {
	if sc.slot != nil {
		if st := sc.slot.st.Load(); st != nil && st.owner == s && !st.gone.Load() && st.key.org == org {
			return st
		}
	}
	if v, ok := s.idx.Load(sliceKey{org, sc.Kind, sc.ID}); ok {
		st := v.(*sliceScope)
		if sc.slot != nil {
			sc.slot.st.Store(st)
		}
		return st
	}
	return nil
}

func (s *slicer) scope(org string, sc *Scope) *sliceScope {
	if st := s.lookup(org, sc); st != nil {
		return st
	}
	k := sliceKey{org, sc.Kind, sc.ID}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.m[k]
	if st == nil {
		kb := newKeyBuilder(s.lim.cfg.KeyPrefix, org)
		keys := kb.scope(sc)
		st = &sliceScope{owner: s, key: k, hkey: keys[0], pkey: keys[1], scope: ScopeRef{Kind: sc.Kind, ID: sc.ID},
			rpm: sc.RPM, tpm: sc.TPM, par: sc.MaxParallel, bud: cloneBudget(sc.Budget),
			rets: map[int64]sliceRet{}, frets: map[int64]sliceRet{}, brets: map[bretKey]int64{}, pall: map[string]struct{}{}}
		if st.bud != nil {
			st.bunit, _ = budget.ParseWindow(st.bud.Window) // validated by Admit
		}
		s.m[k] = st
		s.idx.Store(k, st)
	}
	if sc.slot != nil {
		sc.slot.st.Store(st)
	}
	return st
}

func cloneBudget(b *Budget) *Budget {
	if b == nil {
		return nil
	}
	c := *b
	return &c
}

func sameBudget(a, b *Budget) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// take admits what it can of req's limits from slices: it returns the
// takes and the request Redis must still check (limits taken locally
// zeroed; scopes left with nothing to check left out). headers are the
// local rate headers of the scopes taken. Limits that could not be taken
// record their demand, so the worker carves for them.
//
// lease, when not nil, is allocated with the takes (one allocation):
// Admit uses it for a request admitted entirely from slices.
func (s *slicer) take(req *Request) (takes []sliceTake, rest []Scope, hdr RateHeaders, waits []*sliceScope, lease *Lease) {
	now := s.now()
	// left[i] is what scope i still needs Redis for (a bit per kind:
	// rate, budget, concurrency); the rest is built only when some scope
	// has anything left, so a request that fits its slices allocates
	// nothing for it.
	const leftR, leftB, leftP = 1, 2, 4
	var leftBuf [16]uint8
	left := leftBuf[:0]
	if len(req.Scopes) > len(leftBuf) {
		left = make([]uint8, 0, len(req.Scopes))
	}
	anyLeft := false
	// Redis did not answer lately: admitted exactly (and so fail closed
	// within the call timeout, as without slices); demand is recorded.
	live := s.live(now)
	kick := false
	defer func() {
		if kick {
			s.kick()
		}
	}()
	for i := range req.Scopes {
		sc := &req.Scopes[i]
		var lf uint8
		if sc.RPM > 0 || sc.TPM > 0 {
			lf |= leftR
		}
		if sc.Budget != nil {
			lf |= leftB
		}
		if sc.MaxParallel > 0 {
			lf |= leftP
		}
		okR, okB, okP := s.rateOK(sc), s.budgetOK(sc), s.parOK(sc)
		if !okR && !okB && !okP {
			if st := s.lookup(req.OrgID, sc); st != nil {
				st.mu.Lock()
				st.limitsLocked(sc)
				st.mu.Unlock()
			}
			left = append(left, lf)
			anyLeft = anyLeft || lf != 0
			continue
		}
		if takes == nil {
			// At most one take for this scope and each of the next,
			// allocated with the lease of a request that fits its slices.
			if n := len(req.Scopes) - i; n <= len(slicedLease{}.takes) {
				sl := new(slicedLease)
				sl.lease.born = now // Admit's, if it admits from slices alone
				lease, takes = &sl.lease, sl.takes[:0:n]
			} else {
				takes = make([]sliceTake, 0, n)
			}
		}
		st := s.scope(req.OrgID, sc)
		tk := sliceTake{sc: st}
		st.mu.Lock()
		// The limits changed (admin API, snapshot): slices carved under
		// the old ones are returned, none is used again.
		st.limitsLocked(sc)
		tookR, tookB, tookP := false, false, false
		if okR {
			needT := int64(0)
			if sc.TPM > 0 {
				needT = req.EstTokens
			}
			needR := int64(0)
			if sc.RPM > 0 {
				needR = 1
			}
			st.usedR += needR
			st.usedT += needT
			st.maxT = max(st.maxT, needT)
			st.lastUse = now
			for j := range st.held {
				h := &st.held[j]
				// Within the watermarks Redis holds: what was used of the
				// lease stays below them (a dead data plane's unused rest
				// above them goes back when its lease expires).
				if live && h.deadline.After(now) && h.r >= needR && h.t >= needT &&
					h.gR-h.r+needR <= h.wR && h.gT-h.t+needT <= h.wT {
					h.r -= needR
					h.t -= needT
					tk.kinds |= takeRate
					tk.bucket, tk.r, tk.t, tk.hasTPM = h.bucket, needR, needT, sc.TPM > 0
					tookR = true
					break
				}
			}
			if tookR {
				st.headersLocked(now, sc, &hdr)
			}
		}
		if okB {
			cost := req.MaxCostMicros
			st.usedB += cost
			st.maxB = max(st.maxB, cost)
			st.lastUse, st.lastBud = now, now
			for j := range st.bheld {
				h := &st.bheld[j]
				if live && h.deadline.After(now) && h.free >= cost && st.bN+cost <= st.bB &&
					now.Before(st.bsent.Add(s.lim.cfg.LeaseTTL-s.lim.cfg.RenewInterval)) {
					h.free -= cost
					st.bN += cost
					tk.kinds |= takeBudget
					tk.cost, tk.widx, tk.epoch, tk.bgen = cost, h.widx, h.epoch, st.bgen
					tookB = true
					break
				}
			}
		}
		if okP {
			st.lastUse, st.lastPar = now, now
			if n := len(st.pfree); n > 0 && live && st.parUsableLocked(now, s.lim.cfg.RenewInterval) {
				m := st.pfree[n-1]
				st.pfree = st.pfree[:n-1]
				st.puse++
				tk.kinds |= takePar
				tk.member, tk.pgen = m, st.pgen
				tookP = true
				st.pdemand = max(st.pdemand, st.puse+st.pexact)
			} else {
				// Admitted exactly: still demand for a slot until it ends
				// (so a jump in concurrency is carved for in one tick).
				st.pexact++
				st.pdemand = max(st.pdemand, st.puse+st.pexact)
				waits = append(waits, st)
			}
		}
		if !st.inflight && ((okR && !tookR && !now.Before(st.backoff)) || (okB && !tookB && !now.Before(st.bbackoff)) ||
			(okP && !tookP && !now.Before(st.pbackoff))) {
			kick = true
		}
		st.mu.Unlock()
		if tk.kinds != 0 {
			takes = append(takes, tk)
		}
		if tookR {
			lf &^= leftR
		}
		if tookB {
			lf &^= leftB
		}
		if tookP {
			lf &^= leftP
		}
		left = append(left, lf)
		anyLeft = anyLeft || lf != 0
	}
	if len(takes) == 0 {
		return nil, req.Scopes, hdr, waits, nil
	}
	if !anyLeft {
		return takes, nil, hdr, waits, lease
	}
	// The scopes with anything left, without the limits taken locally.
	for i, sc := range req.Scopes {
		lf := left[i]
		if lf == 0 {
			continue
		}
		if rest == nil {
			rest = make([]Scope, 0, len(req.Scopes))
		}
		if lf&leftR == 0 {
			sc.RPM, sc.TPM = 0, 0
		}
		if lf&leftB == 0 {
			sc.Budget = nil
		}
		if lf&leftP == 0 {
			sc.MaxParallel = 0
		}
		rest = append(rest, sc)
	}
	return takes, rest, hdr, waits, lease
}

// slicedLease is the lease of a request admitted from slices and its
// takes, allocated together: one take per scope, for up to four scopes
// (key, user or member, team and org levels).
type slicedLease struct {
	lease Lease
	takes [4]sliceTake
}

// unwait ends the slot demand of an exact admission (take's waits).
func (s *slicer) unwait(waits []*sliceScope) {
	for _, st := range waits {
		st.mu.Lock()
		st.pexact = max(st.pexact-1, 0)
		st.mu.Unlock()
	}
}

// limitsLocked revokes the slices of each kind whose limits changed (to
// any value: a lowered limit must not be admitted from slices carved under
// the old one; a raised one carves anew).
func (st *sliceScope) limitsLocked(sc *Scope) {
	if st.rpm != sc.RPM || st.tpm != sc.TPM {
		st.revokeLocked()
		st.rpm, st.tpm = sc.RPM, sc.TPM
	}
	if !sameBudget(st.bud, sc.Budget) {
		st.revokeBudgetLocked()
		st.bud = cloneBudget(sc.Budget)
		st.bunit = budget.Unit{}
		if st.bud != nil {
			st.bunit, _ = budget.ParseWindow(st.bud.Window)
		}
	}
	if st.par != sc.MaxParallel {
		st.revokeParLocked()
		st.par = sc.MaxParallel
	}
}

// parUsableLocked reports whether a free member may be given to a new
// request: its lease was renewed within two renew intervals (so a data
// plane that cannot reach Redis stops admitting from its slots within
// about 2 s, as it stops admitting exactly at once).
func (st *sliceScope) parUsableLocked(now time.Time, interval time.Duration) bool {
	return !st.plost && now.Before(st.psent.Add(2*interval))
}

// headersLocked merges the scope's local view into hdr (least remaining
// of each kind): the fleet's remaining at the last carve plus what this
// data plane's slices still hold.
func (st *sliceScope) headersLocked(now time.Time, sc *Scope, hdr *RateHeaders) {
	var lr, lt int64
	for _, h := range st.held {
		if h.deadline.After(now) {
			lr += h.r
			lt += h.t
		}
	}
	el := now.Sub(st.carvedAt)
	if sc.RPM > 0 {
		rem := min(st.remR+lr, sc.RPM)
		if hdr.LimitRequests == 0 || rem < hdr.RemainingRequests {
			hdr.LimitRequests, hdr.RemainingRequests, hdr.ResetRequests = sc.RPM, rem, max(st.resetR-el, 0)
		}
	}
	if sc.TPM > 0 {
		rem := min(st.remT+lt, sc.TPM)
		if hdr.LimitTokens == 0 || rem < hdr.RemainingTokens {
			hdr.LimitTokens, hdr.RemainingTokens, hdr.ResetTokens = sc.TPM, rem, max(st.resetT-el, 0)
		}
	}
}

// mergeHeaders keeps the least remaining of each kind.
func mergeHeaders(a, b RateHeaders) RateHeaders {
	if b.LimitRequests > 0 && (a.LimitRequests == 0 || b.RemainingRequests < a.RemainingRequests) {
		a.LimitRequests, a.RemainingRequests, a.ResetRequests = b.LimitRequests, b.RemainingRequests, b.ResetRequests
	}
	if b.LimitTokens > 0 && (a.LimitTokens == 0 || b.RemainingTokens < a.RemainingTokens) {
		a.LimitTokens, a.RemainingTokens, a.ResetTokens = b.LimitTokens, b.RemainingTokens, b.ResetTokens
	}
	return a
}

// revokeLocked gives every held rate slice back (returned by the next
// carve call) and makes replies of carves in flight go back too.
func (st *sliceScope) revokeLocked() {
	for _, h := range st.held {
		st.fretLocked(h.bucket, h.r, h.t)
	}
	st.held = st.held[:0]
	st.gen++
}

// revokeBudgetLocked gives the free part of every budget slice back.
func (st *sliceScope) revokeBudgetLocked() {
	for _, h := range st.bheld {
		st.bretLocked(h.widx, h.epoch, h.free)
	}
	st.bheld = st.bheld[:0]
	st.bgen++
}

// revokeParLocked gives every free member back; members in use go back
// when their requests end.
func (st *sliceScope) revokeParLocked() {
	for _, m := range st.pfree {
		delete(st.pall, m)
		st.pgone = append(st.pgone, m)
	}
	st.pfree = st.pfree[:0]
	st.pgen++
}

func (st *sliceScope) retLocked(bucket, r, t int64) {
	if r == 0 && t == 0 {
		return
	}
	x := st.rets[bucket]
	x.r += r
	x.t += t
	st.rets[bucket] = x
}

// fretLocked queues units a slice did not use (a free return: carve.lua
// applies it only while this data plane's rate lease of the bucket holds
// them).
func (st *sliceScope) fretLocked(bucket, r, t int64) {
	if r == 0 && t == 0 {
		return
	}
	x := st.frets[bucket]
	x.r += r
	x.t += t
	st.frets[bucket] = x
}

func (st *sliceScope) bretLocked(widx, epoch, amount int64) {
	if amount == 0 {
		return
	}
	st.brets[bretKey{widx, epoch}] += amount
}

// giveBackLocked returns r requests and t tokens (t < 0: a debt) of a
// rate take: into its slice while that is held and usable, else to Redis;
// st.mu held.
func (st *sliceScope) giveBackLocked(tk *sliceTake, r, t int64, now time.Time) {
	if t >= 0 {
		for j := range st.held {
			h := &st.held[j]
			if h.bucket == tk.bucket && h.deadline.After(now) {
				h.r += r
				h.t += t
				return
			}
		}
	}
	st.retLocked(tk.bucket, r, t)
}

// giveBackBudgetLocked returns amount micro-USD of a budget take (< 0: a
// debt): into its slice while that is held and usable, else to Redis;
// st.mu held.
func (st *sliceScope) giveBackBudgetLocked(tk *sliceTake, amount int64, now time.Time) {
	if amount == 0 {
		return
	}
	if amount > 0 && tk.bgen == st.bgen {
		st.bN = max(st.bN-amount, 0)
	}
	if amount > 0 {
		for j := range st.bheld {
			h := &st.bheld[j]
			if h.widx == tk.widx && h.epoch == tk.epoch && h.deadline.After(now) {
				h.free += amount
				return
			}
		}
	}
	st.bretLocked(tk.widx, tk.epoch, amount)
}

// releaseParLocked ends a request's use of a member: free again, or given
// back when the scope's limit changed or its members are no longer
// renewed; st.mu held.
func (st *sliceScope) releaseParLocked(tk *sliceTake) {
	st.puse--
	if _, held := st.pall[tk.member]; !held {
		return // dropped (renewals failed): it expires in Redis by itself
	}
	if tk.pgen == st.pgen && !st.plost {
		st.pfree = append(st.pfree, tk.member)
		return
	}
	delete(st.pall, tk.member)
	st.pgone = append(st.pgone, tk.member)
}

// rollback undoes takes (the rest of the admission rejected or failed).
func (s *slicer) rollback(takes []sliceTake) {
	s.settle(takes, 0, 0, true)
}

// settle reconciles the local takes of a request: the token estimate and
// the cost reservation are replaced by the real usage, the members freed;
// a cancelled request gives everything back. It returns the budget alerts
// carves of these scopes crossed since the last settlement.
//
// Each scope's lock is taken once for all of its kinds (one take per
// scope), as in take: every request of a scope passes through its lock.
func (s *slicer) settle(takes []sliceTake, tokens, cost int64, cancel bool) []BudgetAlert {
	var alerts []BudgetAlert
	now := s.now()
	for i := range takes {
		tk := &takes[i]
		st := tk.sc
		st.mu.Lock()
		if tk.has(takeRate) {
			switch {
			case cancel:
				st.giveBackLocked(tk, tk.r, tk.t, now)
			case tk.hasTPM:
				if d := tk.t - max(tokens, 0); d != 0 {
					st.giveBackLocked(tk, 0, d, now)
				}
			}
		}
		if tk.has(takeBudget) {
			if cancel {
				st.giveBackBudgetLocked(tk, tk.cost, now)
			} else {
				st.giveBackBudgetLocked(tk, tk.cost-max(cost, 0), now)
				if len(st.alerts) > 0 {
					alerts = append(alerts, st.alerts...)
					st.alerts = nil
				}
			}
		}
		if tk.has(takePar) {
			st.releaseParLocked(tk)
		}
		st.mu.Unlock()
	}
	return alerts
}

// requeueAlerts puts back alerts a settlement could not report (its
// exact part failed): the next settlement of the scope reports them.
func (s *slicer) requeueAlerts(takes []sliceTake, alerts []BudgetAlert) {
	for _, a := range alerts {
		for _, tk := range takes {
			if tk.has(takeBudget) && tk.sc.scope == a.Scope {
				tk.sc.mu.Lock()
				tk.sc.alerts = append(tk.sc.alerts, a)
				tk.sc.mu.Unlock()
				break
			}
		}
	}
}

// renewLocal is Renew for the parts of a lease held in slices: a member
// whose lease the worker could not renew in time is lost (RenewLost: the
// caller stops the request before another data plane may get the slot).
func (s *slicer) renewLocal(takes []sliceTake) RenewState {
	now := s.now()
	ttl, iv := s.lim.cfg.LeaseTTL, s.lim.cfg.RenewInterval
	for i := range takes {
		tk := &takes[i]
		if !tk.has(takePar) {
			continue
		}
		st := tk.sc
		st.mu.Lock()
		_, held := st.pall[tk.member]
		lost := !held || !now.Before(st.psent.Add(ttl-iv))
		st.mu.Unlock()
		if lost {
			return RenewLost
		}
	}
	return RenewExtended
}

// RunSlices runs the slice worker until ctx ends: every SliceConfig.Tick
// it returns what slices did not use, renews the concurrency slots held
// and carves new slices for the scopes in demand, one carve.lua call per
// org. On return, every free slice is given back (one last call). It
// returns at once when slices are off.
func (l *Limiter) RunSlices(ctx context.Context) error {
	s := l.slices
	if s == nil {
		<-ctx.Done()
		return nil
	}
	s.running.Store(true)
	defer s.running.Store(false)
	t := time.NewTicker(s.cfg.Tick)
	defer t.Stop()
	hctx, stopBeat := context.WithCancel(ctx)
	beat := make(chan struct{})
	go func() { defer close(beat); s.heartbeat(hctx) }()
	defer func() { stopBeat(); <-beat }()
	// A tick's calls are not cut short by the shutdown: a carve aborted
	// mid-flight may have run, and what it carved (and the returns it
	// carried, dropped as for any failed call) would stay counted until
	// the lease expires, where a finished one is given back exactly by
	// release. Each call keeps its own timeout.
	wctx := context.WithoutCancel(ctx)
	for {
		select {
		case <-ctx.Done():
			s.release()
			return nil
		case done := <-s.flush:
			s.release()
			// Carves that were in flight when the slices were revoked
			// are given back as they land (applyCarve): one more call
			// sends what they queued.
			s.release()
			close(done)
		case <-t.C:
			s.tick(wctx, false)
		case <-s.wake:
			s.tmu.Lock()
			early := s.now().Sub(s.lastTick) >= s.cfg.Tick/5
			s.tmu.Unlock()
			if early {
				s.tick(wctx, false)
			}
		}
	}
}

// ReturnSlices gives back every quota slice this limiter holds (rate
// units to their buckets, free budget to its window, free slots out of the
// lease sets) and returns once the worker's call carrying them was
// answered, or ctx ended. A drained data plane calls it (Handler.Drain):
// slices held for requests that will not come would otherwise stay counted
// until the scopes linger. Later requests carve anew. Without a running
// worker (RunSlices) it does nothing.
func (l *Limiter) ReturnSlices(ctx context.Context) error {
	s := l.slices
	if s == nil || !s.running.Load() {
		return nil
	}
	done := make(chan struct{})
	select {
	case s.flush <- done:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// release revokes every slice and returns them (shutdown, ReturnSlices).
func (s *slicer) release() {
	s.mu.RLock()
	for _, st := range s.m {
		st.mu.Lock()
		st.revokeLocked()
		st.revokeBudgetLocked()
		st.revokeParLocked()
		st.usedR, st.usedT, st.rateR, st.rateT, st.usedB, st.rateB = 0, 0, 0, 0, 0, 0
		// No demand left to carve for (ReturnSlices: the worker keeps
		// running, and the recent demand would carve again at once): the
		// scope lingers from now on until a request comes.
		st.maxB, st.ppeak, st.pdemand = 0, 0, 0
		st.lastUse, st.lastBud, st.lastPar = time.Time{}, time.Time{}, time.Time{}
		st.mu.Unlock()
	}
	s.mu.RUnlock()
	ctx, cancel := context.WithTimeout(context.Background(), 4*s.lim.cfg.CallTimeout)
	defer cancel()
	s.tick(ctx, true)
}

// carveItem is one scope's part of a carve call.
type carveItem struct {
	st           *sliceScope
	gen          uint64
	rpm, tpm     int64
	wantR, wantT int64
	rets         map[int64]sliceRet
	frets        map[int64]sliceRet
	// rate leases: the watermarks of a new one, raises of the held ones
	aheadR, aheadT int64
	raises         []rlRaise
	rsend          bool // a raise is due
	// budget
	bgen  uint64
	bud   *Budget
	bunit budget.Unit
	wantB int64
	brets map[bretKey]int64
	bwm   int64 // the watermark asked for
	bsend bool  // the lease is renewed or its watermark raised
	// concurrency
	pgen   uint64
	par    int64
	wantP  int64
	pseq   int64    // the first new member's number
	renew  []string // members to renew (every member held)
	gone   []string // members to remove
	sent   time.Time
	epoch  int64 // the epoch the scope's slices were carved in
	parRen bool
}

// tick expires slices, updates demand and sends returns, renewals and
// carves.
func (s *slicer) tick(ctx context.Context, final bool) {
	now := s.now()
	// The time since the last tick (a tick may come early, kicked by a
	// request that found no slice): rates are per second of it, and the
	// moving averages and decays are per Tick of it.
	s.tmu.Lock()
	dt := s.cfg.Tick
	if !s.lastTick.IsZero() {
		dt = min(max(now.Sub(s.lastTick), s.cfg.Tick/10), 10*s.cfg.Tick)
	}
	s.lastTick = now
	s.tmu.Unlock()
	tickSec := dt.Seconds()
	ticks := float64(dt) / float64(s.cfg.Tick)
	alpha := 1 - math.Pow(0.8, ticks)
	decB, decP := math.Pow(15.0/16, ticks), math.Pow(0.97, ticks)
	bucket := s.lim.cfg.rateBucket
	ttl, iv := s.lim.cfg.LeaseTTL, s.lim.cfg.RenewInterval
	byOrg := map[string][]carveItem{}
	var idle []sliceKey
	s.mu.RLock()
	held := len(s.m) > 0
	for k, st := range s.m {
		st.mu.Lock()
		// Rate: expired slices give back what they did not use.
		kept := st.held[:0]
		for _, h := range st.held {
			if h.deadline.After(now) {
				kept = append(kept, h)
			} else {
				st.fretLocked(h.bucket, h.r, h.t)
			}
		}
		st.held = kept
		st.maxT = int64(float64(st.maxT) * decB)
		st.rateR = (1-alpha)*st.rateR + alpha*float64(st.usedR)/tickSec
		st.rateT = (1-alpha)*st.rateT + alpha*float64(st.usedT)/tickSec
		st.rateB = (1-alpha)*st.rateB + alpha*float64(st.usedB)/tickSec
		// Hot: demand within the last bucket (an idle scope stops carving
		// at once and gives back what it holds when it expires).
		hot := st.usedR > 0 || st.usedT > 0 || st.usedB > 0 || now.Sub(st.lastUse) < bucket
		st.usedR, st.usedT, st.usedB = 0, 0, 0
		it := carveItem{st: st, gen: st.gen, rpm: st.rpm, tpm: st.tpm, bgen: st.bgen, pgen: st.pgen, par: st.par, sent: now, epoch: st.epoch}
		rateOn := st.rpm > 0 || st.tpm > 0
		if hot && !final && rateOn && (st.rpm == 0 || st.rpm >= s.cfg.MinRPM) && (st.tpm == 0 || st.tpm >= s.cfg.MinTPM) &&
			!st.inflight && !now.Before(st.backoff) {
			// Enough for the life of a slice (up to 1.5 buckets) at the
			// recent rate, with headroom.
			horizon := 2 * bucket.Seconds()
			if st.rpm > 0 {
				it.wantR = int64(math.Ceil(st.rateR*horizon)) + 1
			}
			if st.tpm > 0 {
				it.wantT = int64(math.Ceil(st.rateT*horizon)) + 1
			}
			if !st.needsCarveLocked(now, it.wantR, it.wantT, bucket) {
				it.wantR, it.wantT = 0, 0
			}
		}
		if len(st.rets) > 0 {
			it.rets = st.rets
			st.rets = map[int64]sliceRet{}
		}
		if len(st.frets) > 0 {
			it.frets = st.frets
			st.frets = map[int64]sliceRet{}
		}
		s.tickRateLeaseLocked(st, &it, now, final, bucket)
		s.tickBudgetLocked(st, &it, now, final, decB)
		s.tickParLocked(st, &it, now, final, ttl, iv, decP)
		if st.bud != nil && (it.wantB > 0 || it.brets != nil || it.bsend) {
			it.bud, it.bunit = st.bud, st.bunit
		}
		send := it.wantR > 0 || it.wantT > 0 || it.rets != nil || it.frets != nil || it.rsend || it.wantB > 0 || it.brets != nil || it.bsend ||
			it.wantP > 0 || it.gone != nil || it.parRen
		if send && !st.inflight {
			st.inflight = true
			byOrg[k.org] = append(byOrg[k.org], it)
		} else if send {
			// A call of this scope is in flight: what this tick collected
			// waits for the next.
			st.requeueLocked(&it)
		} else if !hot && len(st.held) == 0 && len(st.bheld) == 0 && len(st.pall) == 0 && st.puse == 0 &&
			now.Sub(st.lastUse) > s.cfg.Idle {
			idle = append(idle, k)
		}
		st.mu.Unlock()
	}
	s.mu.RUnlock()
	if len(idle) > 0 {
		s.mu.Lock()
		for _, k := range idle {
			if st := s.m[k]; st != nil {
				st.mu.Lock()
				if len(st.held) == 0 && len(st.rets) == 0 && len(st.frets) == 0 && len(st.bheld) == 0 && len(st.brets) == 0 && len(st.pall) == 0 &&
					len(st.pgone) == 0 && st.puse == 0 && !st.inflight && s.now().Sub(st.lastUse) > s.cfg.Idle {
					delete(s.m, k)
					s.idx.Delete(k)
					st.gone.Store(true) // for the Scope slots that remember it
				}
				st.mu.Unlock()
			}
		}
		s.mu.Unlock()
	}
	s.held.Store(held)
	if len(byOrg) > 0 {
		s.carve(ctx, byOrg)
	} else if !final && held && now.UnixNano()-s.aliveSent.Load() >= int64(s.cfg.Tick/2) {
		// Nothing else to send, and slices may be in use: a ping (as the
		// heartbeat sends between ticks).
		s.pings.Add(1)
		pctx, cancel := context.WithTimeout(ctx, s.lim.cfg.CallTimeout)
		_ = s.lim.store.ping(pctx)
		cancel()
	}
}

// heartbeat pings Redis every Tick/5 while the slicer holds scopes and no
// other answered call was sent since the last beat, one ping at a time
// (each waits up to liveWindow): so slices stay usable while Redis answers
// within about the call timeout, whatever the worker's own calls do.
func (s *slicer) heartbeat(ctx context.Context) {
	every := max(s.cfg.Tick/5, time.Millisecond)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !s.held.Load() || s.now().UnixNano()-s.aliveSent.Load() < int64(every) {
			continue
		}
		s.pings.Add(1)
		pctx, cancel := context.WithTimeout(ctx, s.liveWindow())
		_ = s.lim.store.ping(pctx)
		cancel()
	}
}

// requeueLocked puts back what a tick collected for a call it could not
// send (one call per scope at a time).
func (st *sliceScope) requeueLocked(it *carveItem) {
	for b, x := range it.rets {
		st.retLocked(b, x.r, x.t)
	}
	for b, x := range it.frets {
		st.fretLocked(b, x.r, x.t)
	}
	for k, x := range it.brets {
		st.bretLocked(k.widx, k.epoch, x)
	}
	st.pgone = append(st.pgone, it.gone...)
}

// tickRateLeaseLocked decides the watermarks of the scope's rate leases:
// what requests may use of each held slice before the next call, half a
// bucket of demand (and four of the largest token estimates) ahead of
// what they used; raised when less than half of that is left. A data
// plane that dies leaves that much of its unused units counted until its
// bucket leaves the window; the rest goes back when its lease expires.
func (s *slicer) tickRateLeaseLocked(st *sliceScope, it *carveItem, now time.Time, final bool, bucket time.Duration) {
	half := bucket.Seconds() / 2
	if st.rpm > 0 {
		it.aheadR = int64(math.Ceil(st.rateR*half)) + 4
	}
	if st.tpm > 0 {
		it.aheadT = int64(math.Ceil(st.rateT*half)) + 4*st.maxT + 1
	}
	if final || len(st.held) == 0 {
		return
	}
	it.raises = make([]rlRaise, 0, len(st.held))
	for _, h := range st.held {
		if !h.deadline.After(now) {
			continue
		}
		uR, uT := h.gR-h.r, h.gT-h.t
		x := rlRaise{bucket: h.bucket, r: max(h.wR, uR+it.aheadR), t: max(h.wT, uT+it.aheadT)}
		it.raises = append(it.raises, x)
		if (h.wR < h.gR && h.wR-uR < it.aheadR/2) || (h.wT < h.gT && h.wT-uT < it.aheadT/2) {
			it.rsend = true
		}
	}
}

// tickBudgetLocked expires budget slices, gives back the free ones of a
// scope without demand, and decides the budget carve of it.
func (s *slicer) tickBudgetLocked(st *sliceScope, it *carveItem, now time.Time, final bool, dec float64) {
	ttl, iv := s.lim.cfg.LeaseTTL, s.lim.cfg.RenewInterval
	if len(st.bheld) > 0 && !now.Before(st.bsent.Add(ttl-iv)) {
		// The lease was not renewed for a lease TTL less a renew
		// interval: it may expire (and its slices be reclaimed), so they
		// are not used again.
		st.revokeBudgetLocked()
	}
	linger := now.Sub(st.lastBud) > s.cfg.Linger
	kept := st.bheld[:0]
	for _, h := range st.bheld {
		if h.deadline.After(now) && !linger {
			kept = append(kept, h)
		} else {
			st.bretLocked(h.widx, h.epoch, h.free)
		}
	}
	st.bheld = kept
	st.maxB = int64(float64(st.maxB) * dec)
	if len(st.brets) > 0 {
		it.brets = st.brets
		st.brets = map[bretKey]int64{}
	}
	// The watermark: what requests may take from the slices before the
	// next call, a few ticks of demand ahead (what a data plane that dies
	// may have spent unseen; the rest of its slices is reclaimed when its
	// lease expires). Raised when less than half of that is left; the
	// lease is renewed once per renew interval while slices are held.
	ahead := int64(math.Ceil(st.rateB*20*s.cfg.Tick.Seconds())) + 4*st.maxB + 1
	it.bwm = max(st.bB, st.bN+ahead)
	if !final && st.bud != nil && len(st.bheld) > 0 && (st.bB-st.bN < ahead/2 || now.Sub(st.bsent) >= iv-s.cfg.Tick) {
		it.bsend = true
	}
	if final || linger || st.bud == nil || st.bud.CapMicros < s.cfg.MinBudgetMicros || st.inflight || now.Before(st.bbackoff) {
		return
	}
	// Enough for the life of a slice at the recent rate, and for a few
	// requests as large as the largest seen.
	want := int64(math.Ceil(st.rateB*s.cfg.BudgetLife.Seconds())) + 4*st.maxB + 1
	var free int64
	var last time.Time
	for _, h := range st.bheld {
		free += h.free
		if h.deadline.After(last) {
			last = h.deadline
		}
	}
	if len(st.bheld) == 0 || last.Sub(now) < s.cfg.BudgetLife/2 || free < want/2 {
		it.wantB = want
	}
}

// tickParLocked decides the concurrency part of a scope's call: members
// to renew (every held one, once per renew interval), to give back (free
// ones beyond twice the demand, all of them once the scope lingers) and
// to carve (up to one and a half times the peak demand).
func (s *slicer) tickParLocked(st *sliceScope, it *carveItem, now time.Time, final bool, ttl, iv time.Duration, dec float64) {
	st.ppeak = max(float64(st.pdemand), st.ppeak*dec)
	st.pdemand = st.puse + st.pexact
	if len(st.pall) > 0 && !st.plost && !now.Before(st.psent.Add(ttl-iv)) {
		// Renewals failed for a whole lease TTL less a renew interval: the
		// members may be given away; none is used again, and the ones in
		// use make their requests stop (renewLocal).
		st.plost = true
		for m := range st.pall {
			delete(st.pall, m)
		}
		st.pfree = st.pfree[:0]
	}
	if st.plost && len(st.pall) == 0 && st.puse == 0 {
		st.plost = false // a fresh start: new members get new names
	}
	linger := now.Sub(st.lastPar) > s.cfg.Linger
	target := int64(math.Ceil(1.5*st.ppeak)) + 2
	if linger || final || st.par < s.cfg.MinParallel {
		target = 0
	}
	held := int64(len(st.pall))
	if excess := held - max(2*target, target+2); excess > 0 || target == 0 {
		if target == 0 {
			excess = int64(len(st.pfree))
		}
		for ; excess > 0 && len(st.pfree) > 0; excess-- {
			m := st.pfree[len(st.pfree)-1]
			st.pfree = st.pfree[:len(st.pfree)-1]
			delete(st.pall, m)
			st.pgone = append(st.pgone, m)
		}
	}
	if len(st.pgone) > 0 {
		it.gone = st.pgone
		st.pgone = nil
	}
	if len(st.pall) > 0 && now.Sub(st.psent) >= iv-s.cfg.Tick && !final {
		it.parRen = true
		it.renew = make([]string, 0, len(st.pall))
		for m := range st.pall {
			it.renew = append(it.renew, m)
		}
	}
	if !final && !st.plost && target > 0 && held < target && !st.inflight && !now.Before(st.pbackoff) {
		it.wantP = target - held
		it.pseq = st.pseq
	}
}

// needsCarveLocked reports whether the scope should carve now: no usable
// slice, or the ones held are low or end within half a bucket.
func (st *sliceScope) needsCarveLocked(now time.Time, wantR, wantT int64, bucket time.Duration) bool {
	var r, t int64
	var last time.Time
	for _, h := range st.held {
		r += h.r
		t += h.t
		if h.deadline.After(last) {
			last = h.deadline
		}
	}
	if len(st.held) == 0 || last.Sub(now) < bucket/2 {
		return true
	}
	return (st.rpm > 0 && r < wantR/2) || (st.tpm > 0 && t < wantT/2)
}

// carve sends one carve.lua call per org (pipelined) and applies the
// replies.
func (s *slicer) carve(ctx context.Context, byOrg map[string][]carveItem) {
	var calls []scriptCall
	var groups [][]carveItem
	for org, items := range byOrg {
		for len(items) > 0 {
			n := min(len(items), maxSliceItemsPerCall)
			calls = append(calls, s.carveCall(org, items[:n]))
			groups = append(groups, items[:n])
			items = items[n:]
		}
	}
	n := 0
	for _, g := range groups {
		n += len(g)
	}
	// Off the request path: a worker call has four call timeouts (and one
	// more per 32 scopes), so a busy Redis that times out admissions still
	// answers the carves that take the load off it.
	cctx, cancel := context.WithTimeout(ctx, s.lim.cfg.CallTimeout*time.Duration(4+n/32))
	defer cancel()
	sent := s.now()
	s.calls.Add(int64(len(calls)))
	vals, errs := s.lim.store.evalBatch(cctx, carveScript, calls)
	for _, c := range calls {
		c.args.release()
	}
	// Alerts the carves raise: to the sink once every reply is applied
	// (no scope lock held), or to the scopes' next settlements.
	sink := s.lim.carveAlerts.Load()
	var raised []BudgetAlert
	defer func() {
		if sink != nil && len(raised) > 0 {
			(*sink)(raised)
		}
	}()
	for g, items := range groups {
		v := vals[g]
		if errs[g] != nil || len(v) < 1 {
			s.carveFailed(items, sent)
			continue
		}
		epoch := v[0]
		j := 1
		ok := true
		for _, it := range items {
			if j+carveFixed > len(v) || j+carveFixed+2*int(v[j+carveFixed-1])+1 > len(v) {
				ok = false
				break
			}
			o := v[j : j+carveFixed]
			na := int(o[carveFixed-1])
			al := v[j+carveFixed : j+carveFixed+2*na]
			j += carveFixed + 2*na
			ne := int(v[j])
			if ne < 0 || j+1+5*ne > len(v) {
				ok = false
				break
			}
			rl := v[j+1 : j+1+5*ne]
			j += 1 + 5*ne
			raised = append(raised, s.applyCarve(it, o, al, rl, epoch, sent, sink != nil)...)
		}
		if !ok || j != len(v) {
			// Nothing is known of the items not applied: as for a failed call.
			s.carveFailed(items, sent)
		}
	}
}

// carveFailed handles items whose call failed: nothing is known to be
// carved; the rate and budget returns are dropped (a return applied twice
// would free units in use, so a call that may have run is not retried:
// dropping only under-admits), members to remove are kept for the next
// call (removing twice is harmless).
func (s *slicer) carveFailed(items []carveItem, sent time.Time) {
	for _, it := range items {
		st := it.st
		st.mu.Lock()
		if st.inflight {
			st.inflight = false
			st.backoff = sent.Add(s.cfg.Tick * 4)
			st.bbackoff = st.backoff
			st.pbackoff = st.backoff
			st.pgone = append(st.pgone, it.gone...)
			if it.wantP > 0 {
				// The call may have added the members: the next call
				// removes them (removing a missing one is harmless).
				for q := int64(0); q < it.wantP; q++ {
					st.pgone = append(st.pgone, s.member(it.pseq+q))
				}
				st.pseq = it.pseq + it.wantP
			}
			// Debts are kept (charging one twice only under-admits);
			// unused budget going back is dropped.
			for k, x := range it.brets {
				if x < 0 {
					st.bretLocked(k.widx, k.epoch, x)
				}
			}
		}
		st.mu.Unlock()
	}
}

// carveFixed is the number of fixed values per item in carve.lua's reply
// (the last one is the number of alert pairs that follow; after them, the
// number of rate leases and their quintuples).
const carveFixed = 17

// applyCarve applies one item's reply: o the fixed values, al the alert
// pairs, rl this data plane's rate leases of the scope (bucket, gr, gt, wr,
// wt quintuples). With sink set it returns the alerts the carve raised
// (for Limiter.OnCarveAlerts); without, the scope keeps them for its next
// settlement.
func (s *slicer) applyCarve(it carveItem, o, al, rl []int64, epoch int64, sent time.Time, sink bool) (raised []BudgetAlert) {
	st := it.st
	st.mu.Lock()
	defer st.mu.Unlock()
	if !st.inflight {
		return // applied by carveFailed already (malformed reply)
	}
	st.inflight = false
	if st.epoch != 0 && st.epoch != epoch {
		// Redis lost the org's state: budget slices carved before it are
		// gone from the spend, and returns into the new state would free
		// what it never counted. Members are re-asserted by this call's
		// renewal (as live requests' leases are by Renew).
		st.bheld = st.bheld[:0]
		st.brets = map[bretKey]int64{}
		st.bgen++
		st.bN, st.bB = 0, 0
		// Rate slices of the old state: its leases are gone, so what they
		// use would not be bounded by a watermark; the window restarted.
		st.held = st.held[:0]
		st.frets = map[int64]sliceRet{}
		st.gen++
	}
	st.epoch = epoch
	if it.bud != nil && st.bgen == it.bgen {
		if o[15] == 1 {
			// The lease is new (none was held, or it expired and was
			// reclaimed): the slices held under the old one are void, and
			// so are their returns.
			st.bheld = st.bheld[:0]
			for k, x := range st.brets {
				if x > 0 {
					delete(st.brets, k)
				}
			}
			st.bN = 0
			st.bgen++
			it.bgen = st.bgen
		}
		st.bB, st.bsent = o[14], it.sent
	}
	// Rate.
	gr, gt, b, life := o[0], o[1], o[2], time.Duration(o[3])*time.Millisecond
	if gr > 0 || gt > 0 {
		if st.gen != it.gen {
			// Revoked while in flight: straight back.
			st.fretLocked(b, gr, gt)
		} else {
			st.addLocked(slice{bucket: b, deadline: it.sent.Add(life - sliceDeadlineMargin), r: gr, t: gt})
		}
	} else if it.wantR > 0 || it.wantT > 0 {
		// Near the limit (or below the reserve): exact admission until the
		// window has room again.
		st.backoff = sent.Add(s.lim.cfg.rateBucket / 2)
	}
	// The rate leases as Redis holds them now: a held slice whose lease is
	// gone (never expected while it is usable) is not used again.
	for j := range st.held {
		h := &st.held[j]
		found := false
		for k := 0; k+4 < len(rl); k += 5 {
			if rl[k] == h.bucket {
				h.gR, h.gT, h.wR, h.wT = rl[k+1], rl[k+2], rl[k+3], rl[k+4]
				found = true
				break
			}
		}
		if !found {
			h.gR, h.gT, h.wR, h.wT = h.r, h.t, 0, 0
		}
	}
	if st.gen == it.gen {
		st.remR, st.resetR = o[4], time.Duration(o[5])*time.Millisecond
		st.remT, st.resetT = o[6], time.Duration(o[7])*time.Millisecond
		st.carvedAt = sent
	}
	// Budget.
	gb, widx, toEnd := o[8], o[9], time.Duration(o[10])*time.Millisecond
	if gb > 0 {
		if st.bgen != it.bgen {
			st.bretLocked(widx, epoch, gb)
		} else {
			life := min(s.cfg.BudgetLife, toEnd)
			st.bheld = append(st.bheld, bslice{widx: widx, epoch: epoch, deadline: it.sent.Add(life - sliceDeadlineMargin), free: gb})
		}
	} else if it.wantB > 0 && o[11] < 0 {
		// The window is not seeded yet: the first exact admission seeds it
		// (from the ledger, within milliseconds). Seeded here, that clears
		// the backoff (seeded); seeded by another data plane, the next
		// carve is a tick away rather than half a bucket, during which the
		// scope's requests would be admitted exactly.
		st.bbackoff = sent.Add(min(s.cfg.Tick, s.lim.cfg.rateBucket/2))
	} else if it.wantB > 0 {
		st.bbackoff = sent.Add(s.lim.cfg.rateBucket / 2)
	}
	for k := 0; k+1 < len(al); k += 2 {
		if it.bud == nil {
			break
		}
		a := BudgetAlert{Scope: st.scope, Percent: al[k], SpendMicros: al[k+1],
			CapMicros: it.bud.CapMicros, SoftMicros: it.bud.SoftMicros, Window: it.bud.Window,
			OrgID: st.key.org, TeamID: it.bud.Team}
		if sink {
			raised = append(raised, a)
		} else {
			st.alerts = append(st.alerts, a)
		}
	}
	// Concurrency.
	gp := o[12]
	if it.parRen && !st.plost {
		st.psent = it.sent
	}
	if it.wantP > 0 {
		st.pseq = it.pseq + it.wantP
	}
	if gp > 0 {
		if len(st.pall) == 0 || !it.parRen {
			// Members carved with no renewal in the call: their lease runs
			// from this carve.
			if len(st.pall) == 0 {
				st.psent = it.sent
			}
		}
		for q := int64(0); q < gp; q++ {
			m := s.member(it.pseq + q)
			if st.pgen != it.pgen || st.plost {
				st.pgone = append(st.pgone, m)
				continue
			}
			st.pall[m] = struct{}{}
			st.pfree = append(st.pfree, m)
		}
	} else if it.wantP > 0 {
		st.pbackoff = sent.Add(s.lim.cfg.rateBucket / 2)
	}
	return raised
}

// seeded lets the budget scopes of needs carve again at once: their
// windows were just seeded, so a carve that found one unseeded and backed
// off (carve.lua's -1) would now get a slice.
func (s *slicer) seeded(org string, needs []SeedNeed) {
	for _, n := range needs {
		v, ok := s.idx.Load(sliceKey{org, n.Scope.Kind, n.Scope.ID})
		if !ok {
			continue
		}
		st := v.(*sliceScope)
		st.mu.Lock()
		st.bbackoff = time.Time{}
		st.mu.Unlock()
	}
}

// member names this data plane's concurrency slot n.
func (s *slicer) member(n int64) string {
	return "~" + s.cfg.Instance + ":" + strconv.FormatInt(n, 10)
}

// addLocked adds a carved slice, merged with a held one of its bucket.
func (st *sliceScope) addLocked(x slice) {
	for j := range st.held {
		if st.held[j].bucket == x.bucket {
			st.held[j].r += x.r
			st.held[j].t += x.t
			if x.deadline.Before(st.held[j].deadline) {
				st.held[j].deadline = x.deadline
			}
			return
		}
	}
	st.held = append(st.held, x)
}

// carveCall builds the carve.lua call of items (one org).
func (s *slicer) carveCall(org string, items []carveItem) scriptCall {
	kb := newKeyBuilder(s.lim.cfg.KeyPrefix, org)
	keys := make([]string, 0, 2+2*len(items))
	keys = append(keys, kb.epoch())
	th := s.lim.cfg.AlertThresholds
	args := newArgv()
	args.int(ms(s.lim.cfg.rateWindow))
	args.int(ms(s.lim.cfg.rateBucket))
	args.int(int64(len(items)))
	args.int(s.cfg.Reserve)
	args.int(s.cfg.Share)
	args.int(ms(s.lim.cfg.LeaseTTL))
	args.int(ms(s.lim.cfg.Quarantine))
	args.str("~" + s.cfg.Instance + ":")
	args.int(int64(len(th)))
	for _, p := range th {
		args.int(p)
	}
	for _, it := range items {
		keys = append(keys, it.st.hkey, it.st.pkey)
		args.int(it.rpm)
		args.int(it.tpm)
		args.int(it.wantR)
		args.int(it.wantT)
		args.int(it.aheadR)
		args.int(it.aheadT)
		args.int(int64(len(it.rets)))
		for b, x := range it.rets {
			args.int(b)
			args.int(x.r)
			args.int(x.t)
		}
		args.int(int64(len(it.frets)))
		for b, x := range it.frets {
			args.int(b)
			args.int(x.r)
			args.int(x.t)
		}
		args.int(int64(len(it.raises)))
		for _, x := range it.raises {
			args.int(x.bucket)
			args.int(x.r)
			args.int(x.t)
		}
		if it.bud == nil {
			args.str("-")
			for range 6 {
				args.int(0)
			}
		} else {
			args.str(it.bunit.Unit)
			args.int(it.bunit.N)
			args.int(it.bud.CapMicros)
			args.int(it.bud.SoftMicros)
			args.int(it.wantB)
			args.int(it.bwm)
			args.int(int64(len(it.brets)))
			for k, x := range it.brets {
				args.int(k.widx)
				args.int(k.epoch)
				args.int(x)
			}
		}
		args.int(it.par)
		args.int(it.wantP)
		args.int(it.pseq)
		args.int(int64(len(it.renew)))
		for _, m := range it.renew {
			args.str(m)
		}
		args.int(int64(len(it.gone)))
		for _, m := range it.gone {
			args.str(m)
		}
	}
	keys = append(keys, kb.budgetLeaseIndex())
	return scriptCall{keys: keys, args: args}
}

// SliceStats is what a limiter's slices hold (tests, metrics).
type SliceStats struct {
	Scopes         int
	HeldR, HeldT   int64
	PendingReturns int
	// HeldBudgetMicros is the free part of the budget slices held;
	// HeldSlots the concurrency slots held (free or in use), SlotsInUse
	// those in use.
	HeldBudgetMicros      int64
	HeldSlots, SlotsInUse int64
	// InFlight counts the scopes with a carve call in flight.
	InFlight int
	// Calls counts the slice worker's carve.lua calls so far.
	Calls int64
}

// SliceStats sums the slices held now.
func (l *Limiter) SliceStats() SliceStats {
	var out SliceStats
	s := l.slices
	if s == nil {
		return out
	}
	now := s.now()
	out.Calls = s.calls.Load()
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, st := range s.m {
		st.mu.Lock()
		out.Scopes++
		for _, h := range st.held {
			if h.deadline.After(now) {
				out.HeldR += h.r
				out.HeldT += h.t
			}
		}
		for _, h := range st.bheld {
			if h.deadline.After(now) {
				out.HeldBudgetMicros += h.free
			}
		}
		out.HeldSlots += int64(len(st.pall))
		out.SlotsInUse += st.puse
		out.PendingReturns += len(st.rets) + len(st.frets) + len(st.brets) + len(st.pgone)
		if st.inflight {
			out.InFlight++
		}
		st.mu.Unlock()
	}
	return out
}

// withWaits attaches an exact admission's slot demand to its lease, or
// ends it when the admission did not admit.
func (s *slicer) withWaits(d Decision, err error, waits []*sliceScope) Decision {
	if len(waits) == 0 {
		return d
	}
	if err == nil && d.Allowed && d.Lease != nil {
		d.Lease.pwait = waits
	} else {
		s.unwait(waits)
	}
	return d
}
