// Package limits enforces rate (rpm, tpm), concurrency (parallel leases) and
// budget limits for every scope of a request in Redis, shared by every data
// plane.
//
// A request is admitted by one Lua script call (one round trip) that checks
// all of its scopes and, only if all pass, consumes or reserves in all of
// them; it is settled by one more call after the response, exactly once per
// request id. Streams renew their leases in between. Every key of a call
// carries the org's hash tag, so the scripts run unchanged on Redis Cluster.
// Every call has its own short timeout; any Redis error or timeout is
// reported as ErrUnavailable and the caller fails closed. docs/limits.md
// describes the semantics, error bounds and failure policy.
package limits

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	"github.com/sluicegw/sluice/internal/budget"
)

// Scope kinds: the levels of SPEC §3 plus the per-model and deployment
// scopes. The ID of a per-model scope is composed by the caller (e.g.
// "<key id>/<model>").
const (
	KindKey        = budget.KindKey
	KindUser       = budget.KindUser
	KindMember     = budget.KindMember
	KindTeam       = budget.KindTeam
	KindOrg        = budget.KindOrg
	KindCustomer   = budget.KindCustomer
	KindProject    = budget.KindProject
	KindTag        = budget.KindTag
	KindKeyModel   = budget.KindKeyModel
	KindTeamModel  = budget.KindTeamModel
	KindDeployment = budget.KindDeployment
)

// BudgetWindow returns the budget window containing t (budget.Window).
func BudgetWindow(window string, t time.Time) (start, end time.Time, err error) {
	return budget.Window(window, t)
}

var validKinds = map[string]bool{
	KindKey: true, KindUser: true, KindMember: true, KindTeam: true, KindOrg: true,
	KindCustomer: true, KindProject: true, KindTag: true, KindKeyModel: true, KindTeamModel: true, KindDeployment: true,
}

// Defaults of Config.
const (
	// DefaultCallTimeout bounds every Redis call on the request path: a
	// healthy Redis answers a script call in well under a millisecond, so 50 ms
	// means "unavailable", not "slow".
	DefaultCallTimeout = 50 * time.Millisecond
	// DefaultLeaseTTL is how long a parallel slot lives without renewal: the
	// time a crashed proxy's slots take to heal.
	DefaultLeaseTTL = 30 * time.Second
	// DefaultRenewInterval is how often callers should Renew a live request.
	// It is much shorter than the lease TTL because it also bounds how fast
	// leases are re-asserted after Redis loses its state (see Quarantine).
	DefaultRenewInterval = time.Second
	// DefaultQuarantine is how long parallel-limited scopes of an org reject
	// after its epoch key was found missing: two renew intervals, so every
	// live request has re-asserted its lease even if one renewal failed.
	DefaultQuarantine = 2 * DefaultRenewInterval
	// DefaultRecordTTL bounds the lifetime of a request record without
	// renewal (longer than any request; renewed by Renew).
	DefaultRecordTTL = 6 * time.Hour
	// DefaultParallelRetryMax caps the retry-after of a parallel rejection:
	// a slot frees when any in-flight request ends, which is not predictable,
	// so the wait reported is the earliest lease expiry bounded by this.
	DefaultParallelRetryMax = time.Second
	// DefaultRateWindow and DefaultRateBucket define the sliding rpm/tpm
	// window: 60 s counted in 1 s buckets.
	DefaultRateWindow = 60 * time.Second
	DefaultRateBucket = time.Second
	// tombstoneTTL is how long a settled request id is remembered, making a
	// late duplicate Settle or Renew a no-op.
	tombstoneTTL = 10 * time.Minute
)

// DefaultAlertThresholds are the budget alert thresholds, in percent of the
// cap (SPEC §8.3).
var DefaultAlertThresholds = []int64{50, 85, 95, 100}

var (
	// ErrUnavailable reports that Redis did not answer within the call
	// timeout or answered with an error. Callers fail closed (503
	// limits_unavailable); rpm/tpm-only requests may use a LocalLimiter when
	// configured to.
	ErrUnavailable = errors.New("limits unavailable")
	// ErrInvalidRequest reports a request the limiter cannot evaluate (a
	// caller bug); it is returned before any Redis call.
	ErrInvalidRequest = errors.New("invalid limits request")
	// ErrDuplicateRequest reports an Admit for a request id that is already
	// admitted and not yet settled.
	ErrDuplicateRequest = errors.New("duplicate request id")
)

// Scope is one level a request is limited at. Zero limits mean "none".
type Scope struct {
	Kind        string // one of the Kind constants
	ID          string
	RPM         int64 // requests per sliding 60 s window
	TPM         int64 // tokens per sliding 60 s window
	MaxParallel int64 // concurrent requests (leases)
	Budget      *Budget
	// LocalFallback is the caller's policy, never sent to Redis: whether
	// this scope's rpm/tpm limits may be enforced by a LocalLimiter while
	// Redis is unavailable.
	LocalFallback bool
	// slot, set by PrepareScopes, remembers the scope's quota slices
	// (slices.go) for the requests that share this Scope, so that they
	// find them without a map lookup.
	slot *sliceSlot
}

// Budget is a spend cap over a window, in micro-USD.
type Budget struct {
	CapMicros  int64 // spend ≥ cap rejects; 0 = soft budget only
	SoftMicros int64 // alert only; 0 = none
	// Window is "<n>h", "<n>d" or "<n>mo" as validated by the admin API;
	// see BudgetWindow for the boundaries. A window whose counter Redis
	// does not hold is started from the ledger (Config.Seeds, seed.go).
	Window string
	// Team is the team the scope's alerts are filed under (the key's team
	// for a key's scopes, the team for a member's or team's; empty for the
	// others). It limits nothing: carves raise alerts with no request to
	// take it from (OnCarveAlerts).
	Team string
}

// Request is what Admit checks.
type Request struct {
	OrgID         string // the hash tag {o:<org>} of every key
	RequestID     string // unique per request; makes Settle idempotent
	Scopes        []Scope
	EstTokens     int64 // conservative token estimate (prompt + max output)
	MaxCostMicros int64 // maximum cost reserved in every budget scope
	// Report, when set, makes the request sweepable: its record keeps the
	// report (and the scopes to settle) and the request joins the org's
	// lease index, so that if its lease expires unsettled (its proxy died)
	// a sweeper settles it with the last report and hands back its usage
	// event (Sweep). Renewals update it (RenewReport).
	Report *Report
	// Reporter, when Report is nil, supplies the report the same way,
	// called only when it is needed: by an admission that writes a record
	// (an exact one). A request admitted entirely from quota slices
	// writes none, so it builds no report (its record, if it lives long
	// enough to need one, is written by a renewal, RenewItem.Report).
	Reporter Reporter
	// Prefill, when set, accounts the request's prefill on one of its
	// scopes (lua/common.lua, "Prefill accounting").
	Prefill *Prefill
	// ScopesChecked tells Admit that ValidateScopes accepted Scopes (a
	// caller that builds one set of scopes for many requests checks it
	// once); the rest of the request is checked each time.
	ScopesChecked bool
}

// PrepareScopes readies a set of scopes that many requests will share, not
// yet shared: it checks them as ValidateScopes does (a set it accepts may
// be admitted with Request.ScopesChecked) and gives each scope a slot
// where the limiter remembers its quota slices. The set must not be
// modified afterwards, other than copied.
func PrepareScopes(scopes []Scope) error {
	if err := ValidateScopes(scopes); err != nil {
		return err
	}
	for i := range scopes {
		scopes[i].slot = new(sliceSlot)
	}
	return nil
}

// ValidateScopes checks scopes as Admit does: a set it accepts may be
// admitted with Request.ScopesChecked.
func ValidateScopes(scopes []Scope) error {
	var errs []error
	for i := range scopes {
		errs = validateScope(errs, i, &scopes[i], nil)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	return nil
}

// Reporter supplies a request's report (Request.Reporter). Report may be
// called from another goroutine than the one that called Admit, once the
// admission returned.
type Reporter interface {
	Report() Report
}

// sweepable reports whether req is admitted sweepable (Report or
// Reporter).
func (r *Request) sweepable() bool { return r.Report != nil || r.Reporter != nil }

// Prefill is a request's prompt prefill, accounted on one scope of its
// admission: the scope's prefill in flight is the sum of the
// contributions of its live leases. A contribution leaves when the lease
// holder reports the first token (Limiter.PrefillDone), when the lease is
// settled, and when the lease expires unrenewed.
type Prefill struct {
	// Scope is the index in Request.Scopes of the scope that accounts it:
	// one limiting concurrency only (MaxParallel > 0, no rpm, tpm or
	// budget), so its state lives exactly as long as its leases.
	Scope int
	// Tokens is the request's uncached prompt tokens (an estimate).
	Tokens int64
	// Cap, when > 0, rejects the request (LimitPrefill) when the scope's
	// prefill in flight is above 0 and would exceed Cap with Tokens. A
	// request finding no prefill in flight is admitted whatever its size.
	Cap int64
}

// PrefillRetryAfter is the retry-after of a prefill rejection: prefill
// drains as first tokens arrive, which no lease expiry tells, so callers
// retry soon (the admission queue also retries at every released slot).
const PrefillRetryAfter = 200 * time.Millisecond

// LimitType names the limit that rejected a request.
type LimitType string

// Limit types, as reported in headers and errors.
const (
	LimitRPM      LimitType = "rpm"
	LimitTPM      LimitType = "tpm"
	LimitParallel LimitType = "parallel"
	LimitBudget   LimitType = "budget"
	LimitPrefill  LimitType = "prefill"
)

// ScopeRef names a scope.
type ScopeRef struct {
	Kind string
	ID   string
}

// Rejection describes why a request was not admitted.
type Rejection struct {
	Scope ScopeRef
	Limit LimitType
	// RetryAfter is the real expected wait: until enough of the sliding
	// window expires (rpm/tpm), the earliest lease expiry bounded by
	// Config.ParallelRetryMax (parallel), the rest of the quarantine
	// (parallel, Quarantined), or until the window resets (budget).
	RetryAfter time.Duration
	// Never is set when the request can never pass this limit as it stands
	// (its token estimate alone exceeds the tpm limit); RetryAfter is then
	// one full window.
	Never bool
	// Quarantined is set when a parallel-limited scope rejected because the
	// org's Redis state was recently lost (see docs/limits.md).
	Quarantined bool
	// Unseeded is set (with Limit budget) when the scope's budget window is
	// missing in Redis and could not be seeded from the ledger within
	// Config.SeedWait (seed.go); Cause says why. Nothing was consumed.
	Unseeded bool
	Cause    error
	// SpendMicros and CapMicros are set for budget rejections.
	SpendMicros int64
	CapMicros   int64
	// WindowEnd is the end of the budget window (budget rejections).
	WindowEnd time.Time
}

// RateHeaders are the values of the x-ratelimit-* headers (SPEC §8.5) for
// the tightest scope (least remaining) of each kind, after this request was
// counted. A zero limit means no scope of the request carries that limit.
type RateHeaders struct {
	LimitRequests     int64
	RemainingRequests int64
	// ResetRequests is the time until the oldest counted requests leave the
	// window (when remaining next grows); 0 when the window is empty.
	ResetRequests   time.Duration
	LimitTokens     int64
	RemainingTokens int64
	ResetTokens     time.Duration
}

// Decision is the outcome of Admit.
type Decision struct {
	Allowed bool
	// Lease is set when Allowed; pass it to Renew while the request lives
	// and to Settle exactly once on every exit path.
	Lease *Lease
	// Rejection is set when not Allowed.
	Rejection *Rejection
	Headers   RateHeaders
	// Epoch is the org's epoch (ms) seen by the call; it changes when Redis
	// lost the org's state.
	Epoch int64
	// PrefillInFlight is the prefill scope's prefill tokens in flight
	// after the call (with the request's when admitted); 0 without
	// Request.Prefill.
	PrefillInFlight int64
	// unseeded lists the budget windows admit.lua found missing (the
	// answer "needs seed"); Admit seeds them and admits again.
	unseeded []SeedNeed
}

// Lease is an admitted request's claim on its scopes. It is not safe to
// Settle concurrently from several goroutines, but Renew and Settle may race
// (a renewal that arrives after Settle is a no-op).
type Lease struct {
	orgID     string
	requestID string
	keys      []string
	scopes    []Scope
	est       int64
	reserved  int64
	needs     bool // false: nothing to renew or settle in Redis (rpm only)
	settled   atomic.Bool
	// local are the limits admitted from quota slices (slices.go),
	// reconciled locally once (localDone); localTPM and localHold say
	// whether they hold anything to settle (tokens; a budget reservation
	// or a concurrency slot).
	local     []sliceTake
	localTPM  bool
	localHold bool
	localDone atomic.Bool
	// pwait are the sliced concurrency scopes the request was admitted
	// in exactly (no free slot): slot demand until it settles (waitDone).
	pwait    []*sliceScope
	waitDone atomic.Bool
	// promote is set for a request admitted entirely from slices with a
	// Report: its first renewal half a renew interval after born writes its
	// record (recorded), so a sweeper publishes its usage event if its data
	// plane dies; pmu orders that write with the local settlement.
	promote  bool
	born     time.Time
	recorded atomic.Bool
	pmu      sync.Mutex
	// sweep is set for a request admitted with a Report (lease.go).
	sweep *sweepState
	// sweepV is what sweep points to for a request admitted entirely
	// from slices (one allocation less).
	sweepV sweepState
	// prefillScope is the 1-based index of the scope accounting the
	// request's prefill (0: none); prefill its contribution, asserted by
	// every renewal.
	prefillScope int
	prefill      atomic.Int64
	// renewMu orders the renewals of a lease with prefill accounting, so
	// that a renewal asserting an older contribution never lands after
	// one asserting a newer (PrefillDone racing the renewal tick).
	renewMu sync.Mutex
}

// Prefill returns the lease's prefill contribution as last set (0 without
// prefill accounting, or after PrefillDone).
func (l *Lease) Prefill() int64 { return l.prefill.Load() }

// HasPrefill reports whether the lease accounts a prefill.
func (l *Lease) HasPrefill() bool { return l.prefillScope > 0 }

// OrgID returns the org of the leased request.
func (l *Lease) OrgID() string { return l.orgID }

// RequestID returns the id of the leased request.
func (l *Lease) RequestID() string { return l.requestID }

// RenewState is the outcome of Renew.
type RenewState int

// Renew outcomes.
const (
	// RenewSettled: the request was already settled; nothing was done.
	RenewSettled RenewState = iota
	// RenewExtended: the leases and the record were extended.
	RenewExtended
	// RenewReasserted: Redis had lost the request (state loss); its leases,
	// token estimate and cost reservation were written again.
	RenewReasserted
	// RenewSwept: a sweeper settled the request after its lease expired
	// (its renewals were late by a whole lease TTL); nothing was done. Its
	// leases and reservation are gone: the caller should stop the request.
	RenewSwept
	// RenewLost: the request holds a concurrency slot of a quota slice
	// whose lease the slice worker could not renew for a lease TTL less a
	// renew interval; the slot may soon be given away: the caller should
	// stop the request.
	RenewLost
)

// SettleResult is the outcome of Settle.
type SettleResult struct {
	// Applied is false when the request was already settled (a no-op).
	Applied bool
	// Swept is set (with Applied false) when a sweeper had settled the
	// request with its last report after its lease expired: this
	// settlement changed nothing.
	Swept bool
	// WithoutRecord is set when Redis no longer held the admission record
	// (state loss, or no renewal for Config.RecordTTL): the actual usage
	// was charged in full to the current windows.
	WithoutRecord bool
	// Alerts are the budget thresholds crossed by this settlement; each
	// fires once per scope, threshold and window across all data planes.
	Alerts []BudgetAlert
}

// BudgetAlert is a budget threshold crossed in a window.
type BudgetAlert struct {
	Scope ScopeRef
	// Percent is the threshold in percent of the cap; 0 means the soft
	// budget.
	Percent     int64
	SpendMicros int64
	CapMicros   int64
	SoftMicros  int64
	// Window is the scope's budget_duration.
	Window string
	// OrgID and TeamID are set on the alerts carves raise (OnCarveAlerts):
	// the org of the scope and its Budget.Team. Alerts of a settlement
	// leave them empty (the request names them).
	OrgID, TeamID string
}

// Config configures a Limiter. Zero durations take the defaults.
type Config struct {
	// Pipe is the limits store of one Redis: the pipelining client of the
	// request path (package redispipe). Exactly one of Pipe and Client is
	// set.
	Pipe *redispipe.Client
	// Client is a *redis.ClusterClient (Redis Cluster), *redis.Client or
	// other redis.Scripter. Clients built from go-redis options must set
	// ContextTimeoutEnabled, or go-redis ignores the per-call deadline.
	Client redis.Scripter
	// KeyPrefix is prepended to every key (before the hash tag); it must not
	// contain '{' or '}'.
	KeyPrefix        string
	CallTimeout      time.Duration
	LeaseTTL         time.Duration
	RenewInterval    time.Duration
	Quarantine       time.Duration
	RecordTTL        time.Duration
	ParallelRetryMax time.Duration
	// AlertThresholds in percent of the cap; nil takes
	// DefaultAlertThresholds, an empty non-nil slice disables them.
	AlertThresholds []int64
	// Seeds answers the ledger's current spend of budget windows Redis
	// does not hold (seed.go); nil: such scopes admit nothing.
	Seeds SeedFunc
	// SeedWait bounds how long one Admit waits for seeds (default
	// DefaultSeedWait).
	SeedWait time.Duration
	// Slices: quota slices of rpm/tpm limits (slices.go); zero: off.
	// The caller runs Limiter.RunSlices while it admits.
	Slices SliceConfig

	// rateWindow and rateBucket override the sliding window in tests.
	rateWindow time.Duration
	rateBucket time.Duration
	// renewUnbatched makes every renewal of RenewBatch a call of its own
	// (benchmarks: what folding renewals saves).
	renewUnbatched bool
	// admitUnbatched makes every admission a call of its own (benchmarks
	// compare it with batching).
	admitUnbatched bool
}

// Limiter enforces limits in Redis. It is safe for concurrent use.
type Limiter struct {
	cfg     Config
	store   store
	flights seedFlights
	slices  *slicer // nil: slices off
	keys    keyCache
	admits  admitBatcher
	// carveAlerts receives the alerts carves raise (OnCarveAlerts).
	carveAlerts atomic.Pointer[func([]BudgetAlert)]
}

// OnCarveAlerts sets fn to receive the budget alerts quota slices raise: a
// carve that reserves a budget slice past a threshold marks the threshold
// sent in Redis, as a settlement does, so it must be reported even when
// no request ever takes from that slice. fn is called from the slice
// worker, with no lock held; it must not block. Without it (nil), those
// alerts go with the next settlement of a request that takes from the
// scope's budget slices.
func (l *Limiter) OnCarveAlerts(fn func([]BudgetAlert)) {
	if fn == nil {
		l.carveAlerts.Store(nil)
		return
	}
	l.carveAlerts.Store(&fn)
}

// New validates cfg, applies defaults and returns a Limiter.
func New(cfg Config) (*Limiter, error) {
	var errs []error
	if (cfg.Client == nil) == (cfg.Pipe == nil) {
		errs = append(errs, errors.New("limits: exactly one of Pipe and Client is required"))
	}
	switch c := cfg.Client.(type) {
	case *redis.Client:
		if !c.Options().ContextTimeoutEnabled {
			errs = append(errs, errors.New("limits: redis.Options.ContextTimeoutEnabled must be true (per-call timeouts)"))
		}
	case *redis.ClusterClient:
		if !c.Options().ContextTimeoutEnabled {
			errs = append(errs, errors.New("limits: redis.ClusterOptions.ContextTimeoutEnabled must be true (per-call timeouts)"))
		}
	}
	if cfg.KeyPrefix != "" && !validTagPart(cfg.KeyPrefix) {
		errs = append(errs, fmt.Errorf("limits: KeyPrefix %q must not contain '{' or '}'", cfg.KeyPrefix))
	}
	def := func(d *time.Duration, v time.Duration, name string) {
		switch {
		case *d == 0:
			*d = v
		case *d < 0:
			errs = append(errs, fmt.Errorf("limits: %s must be positive (got %v)", name, *d))
		}
	}
	def(&cfg.CallTimeout, DefaultCallTimeout, "CallTimeout")
	def(&cfg.LeaseTTL, DefaultLeaseTTL, "LeaseTTL")
	def(&cfg.RenewInterval, DefaultRenewInterval, "RenewInterval")
	def(&cfg.Quarantine, 2*cfg.RenewInterval, "Quarantine")
	def(&cfg.RecordTTL, DefaultRecordTTL, "RecordTTL")
	def(&cfg.ParallelRetryMax, DefaultParallelRetryMax, "ParallelRetryMax")
	def(&cfg.SeedWait, DefaultSeedWait, "SeedWait")
	def(&cfg.rateWindow, DefaultRateWindow, "rate window")
	def(&cfg.rateBucket, DefaultRateBucket, "rate bucket")
	if cfg.RenewInterval >= cfg.LeaseTTL {
		errs = append(errs, fmt.Errorf("limits: RenewInterval (%v) must be shorter than LeaseTTL (%v)", cfg.RenewInterval, cfg.LeaseTTL))
	}
	if cfg.rateBucket > 0 && cfg.rateWindow%cfg.rateBucket != 0 {
		errs = append(errs, errors.New("limits: rate window must be a multiple of the bucket"))
	}
	if cfg.AlertThresholds == nil {
		cfg.AlertThresholds = DefaultAlertThresholds
	}
	for _, p := range cfg.AlertThresholds {
		if p <= 0 || p > 1000 {
			errs = append(errs, fmt.Errorf("limits: alert threshold %d%% out of range 1–1000", p))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	l := &Limiter{cfg: cfg}
	if cfg.Slices.Enabled {
		sc := cfg.Slices
		if sc.MinRPM < 0 || sc.MinTPM < 0 || sc.MinParallel < 0 || sc.MinBudgetMicros < 0 || sc.Reserve < 0 || sc.Reserve >= 1000 ||
			sc.Share < 0 || sc.Tick < 0 || sc.Idle < 0 || sc.Linger < 0 || sc.BudgetLife < 0 {
			return nil, fmt.Errorf("limits: slice settings out of range: %+v", cfg.Slices)
		}
		l.slices = newSlicer(l, cfg.Slices)
	}
	if cfg.Pipe != nil {
		l.store = pipeStore{c: cfg.Pipe}
	} else {
		l.store = goRedisStore{c: cfg.Client}
	}
	if l.slices != nil {
		// Every answered call proves Redis alive (slices are used only
		// while it is, slices.go).
		l.store = liveStore{store: l.store, s: l.slices}
	}
	return l, nil
}

// settleLocal marks the local part of the lease settled, once: true the
// first time. After it, renewRecord writes no record.
func (l *Lease) settleLocal() bool {
	l.pmu.Lock()
	defer l.pmu.Unlock()
	return l.localDone.CompareAndSwap(false, true)
}

// renewRecord renews a request admitted entirely from slices: nothing
// until it has lived half a renew interval (a short request, or a stream's
// renewal kicked when its upstream answers, makes no call), then its
// record is written (slicerec.lua) and renewed with its report at every
// renewal, so a sweeper publishes its usage event if its data plane dies.
func (l *Limiter) renewRecord(ctx context.Context, lease *Lease) (RenewState, error) {
	if !lease.recorded.Load() && time.Since(lease.born) < l.cfg.RenewInterval/2 {
		return RenewExtended, nil
	}
	lease.pmu.Lock()
	defer lease.pmu.Unlock()
	if lease.localDone.Load() {
		return RenewSettled, nil
	}
	ok := l.keys.org(l.cfg.KeyPrefix, lease.orgID)
	keys := []string{ok[0], l.cfg.KeyPrefix + "{o:" + lease.orgID + "}:req:" + lease.requestID, ok[1]} // keyBuilder.record
	args := newArgv()
	defer args.release()
	args.str(lease.requestID)
	args.int(ms(l.cfg.LeaseTTL))
	args.int(ms(l.cfg.RecordTTL))
	args.int(ms(l.cfg.rateBucket))
	lease.sweep.appendNote(args)
	vals, err := l.run(ctx, sliceRecScript, "renew", keys, args)
	if err != nil {
		// It may have run: settle it in Redis too (a no-op if it did not).
		lease.keys = keys[:2]
		lease.recorded.Store(true)
		return 0, err
	}
	lease.keys = keys[:2]
	lease.recorded.Store(true)
	if len(vals) != 1 {
		return 0, fmt.Errorf("%w: slicerec returned %v", ErrUnavailable, vals)
	}
	switch vals[0] {
	case 0:
		return RenewSettled, nil
	case 3:
		return RenewSwept, nil
	}
	return RenewExtended, nil
}

// RenewInterval is how often a caller should Renew each live request.
func (l *Limiter) RenewInterval() time.Duration { return l.cfg.RenewInterval }

// Bootstrap marks an org's Redis state as known-new: it creates the org's
// epoch key, unless it exists, with an epoch that is already past its
// quarantine. Data planes call it when an event creates an org (or a
// deployment, see DeploymentOrg): a missing epoch then means lost state,
// not a new org, and a new org's first requests are not quarantined. An
// existing epoch is never changed, so a loss stays detected.
func (l *Limiter) Bootstrap(ctx context.Context, orgID string) error {
	if !validTagPart(orgID) {
		return fmt.Errorf("%w: org id %q", ErrInvalidRequest, orgID)
	}
	ctx, cancel := context.WithTimeout(ctx, l.cfg.CallTimeout)
	defer cancel()
	if err := l.store.setNX(ctx, newKeyBuilder(l.cfg.KeyPrefix, orgID).epoch(), 0); err != nil {
		return fmt.Errorf("limits bootstrap: %w: %w", ErrUnavailable, err)
	}
	return nil
}

// DeploymentOrg is the hash-tag owner of a deployment's fleet-wide
// max_concurrency leases: deployments are shared by orgs, so their leases
// live in a slot of their own and are taken by a call of their own.
func DeploymentOrg(deploymentID string) string { return "deployment:" + deploymentID }

// LeaseTTL is how long a lease lives without renewal.
func (l *Limiter) LeaseTTL() time.Duration { return l.cfg.LeaseTTL }

// Needs reports whether the lease holds anything in Redis to renew or
// settle (false for requests limited by rpm only).
func (l *Lease) Needs() bool { return l.needs || l.localTPM || l.localHold }

// Local reports whether any of the request's limits were admitted from
// quota slices (no Redis call for them).
func (l *Lease) Local() bool { return len(l.local) > 0 }

// validate checks req before any Redis call.
func validate(req *Request) ([]budget.Unit, error) {
	return validateUnits(req, true)
}

// validateUnits is validate; withUnits false returns no units (nil),
// without allocating them.
func validateUnits(req *Request, withUnits bool) ([]budget.Unit, error) {
	var errs []error
	if !validTagPart(req.OrgID) {
		errs = append(errs, fmt.Errorf("org id %q must be non-empty without '{' or '}'", req.OrgID))
	}
	if req.RequestID == "" {
		errs = append(errs, errors.New("request id is empty"))
	}
	if req.EstTokens < 0 || req.MaxCostMicros < 0 {
		errs = append(errs, errors.New("estimated tokens and max cost must be ≥ 0"))
	}
	if p := req.Prefill; p != nil {
		switch {
		case p.Scope < 0 || p.Scope >= len(req.Scopes):
			errs = append(errs, fmt.Errorf("prefill scope %d of %d", p.Scope, len(req.Scopes)))
		case req.Scopes[p.Scope].MaxParallel <= 0 || req.Scopes[p.Scope].RPM != 0 || req.Scopes[p.Scope].TPM != 0 || req.Scopes[p.Scope].Budget != nil:
			errs = append(errs, fmt.Errorf("prefill scope %d must limit concurrency only", p.Scope))
		}
		if p.Tokens < 0 || p.Cap < 0 {
			errs = append(errs, errors.New("prefill tokens and cap must be ≥ 0"))
		}
	}
	var units []budget.Unit
	if withUnits {
		units = make([]budget.Unit, len(req.Scopes))
	}
	// Scopes checked before (ScopesChecked) are not checked again unless
	// their budget windows' units are wanted.
	if withUnits || !req.ScopesChecked {
		for i := range req.Scopes {
			var u *budget.Unit
			if withUnits {
				u = &units[i]
			}
			errs = validateScope(errs, i, &req.Scopes[i], u)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	return units, nil
}

// validateScope appends what is wrong with scope i to errs; unit, when
// not nil, receives its budget window's unit.
func validateScope(errs []error, i int, s *Scope, unit *budget.Unit) []error {
	if !validKinds[s.Kind] || s.ID == "" {
		errs = append(errs, fmt.Errorf("scope %d: kind %q / id %q", i, s.Kind, s.ID))
	}
	if s.RPM < 0 || s.TPM < 0 || s.MaxParallel < 0 {
		errs = append(errs, fmt.Errorf("scope %s %s: negative limit", s.Kind, s.ID))
	}
	if s.Budget != nil {
		u, err := budget.ParseWindow(s.Budget.Window)
		if err != nil {
			errs = append(errs, fmt.Errorf("scope %s %s: %w", s.Kind, s.ID, err))
		}
		if s.Budget.CapMicros < 0 || s.Budget.SoftMicros < 0 {
			errs = append(errs, fmt.Errorf("scope %s %s: negative budget amount", s.Kind, s.ID))
		}
		if unit != nil {
			*unit = u
		}
	}
	return errs
}

func ms(d time.Duration) int64 { return d.Milliseconds() }

// Admit checks every scope of req and, only if all pass, consumes one
// request (rpm), EstTokens (tpm), a lease (parallel) and a MaxCostMicros
// reservation (budget) in all of them, in one Redis round trip. A Redis
// error or timeout returns ErrUnavailable; the caller then fails closed,
// and should Settle the returned Decision's Lease with zero usage when the
// call may have reached Redis (see MayHaveRun), so a late execution
// consumes nothing for long. A budget window Redis does not hold is first
// seeded from the ledger (seed.go): then Admit takes a few round trips
// more, or rejects with Rejection.Unseeded.
func (l *Limiter) Admit(ctx context.Context, req Request) (Decision, error) {
	sliced := l.slices != nil && req.Prefill == nil
	// With slices the budget units are needed only for an exact call.
	units, err := validateUnits(&req, !sliced)
	if err != nil {
		return Decision{}, err
	}
	if !sliced {
		// A prefill scope limits concurrency only: nothing of it is sliced,
		// and the scope indexes stay those of req.
		return l.admitExact(ctx, req, units)
	}
	takes, rest, hdr, waits, lease := l.slices.take(&req)
	if len(takes) == 0 {
		units, _ = validate(&req) // valid: checked above
		d, err := l.admitExact(ctx, req, units)
		return l.slices.withWaits(d, err, waits), err
	}
	if lease == nil {
		lease = &Lease{born: time.Now()}
	}
	lease.orgID, lease.requestID, lease.est, lease.reserved, lease.local = req.OrgID, req.RequestID, req.EstTokens, req.MaxCostMicros, takes
	for _, tk := range takes {
		lease.localTPM = lease.localTPM || tk.hasTPM
		lease.localHold = lease.localHold || tk.has(takeBudget|takePar)
	}
	if len(rest) == 0 {
		// Every limit fitted its slices: no round trip.
		if req.sweepable() && (lease.localTPM || lease.localHold) {
			lease.sweepV.spec = specVersion
			if req.Report != nil {
				lease.sweepV.rep = *req.Report
			} else {
				lease.sweepV.lazy = req.Reporter
			}
			lease.sweep = &lease.sweepV
			lease.promote = true // born: take's clock
		}
		return Decision{Allowed: true, Lease: lease, Headers: hdr}, nil
	}
	// The rest (budgets, concurrency, scopes without slices) is admitted
	// exactly; the local part is undone unless it admits.
	sub := req
	sub.Scopes = rest
	if units, err = validate(&sub); err != nil {
		l.slices.rollback(takes)
		l.slices.unwait(waits)
		return Decision{}, err
	}
	d, err := l.admitExact(ctx, sub, units)
	if err != nil || !d.Allowed {
		l.slices.rollback(takes)
		l.slices.unwait(waits)
		return d, err
	}
	d.Lease.local, d.Lease.localTPM, d.Lease.localHold = takes, lease.localTPM, lease.localHold
	d.Lease.pwait = waits
	d.Headers = mergeHeaders(d.Headers, hdr)
	return d, nil
}

// admitExact admits req in Redis (admit.lua), seeding missing budget
// windows first.
func (l *Limiter) admitExact(ctx context.Context, req Request, units []budget.Unit) (Decision, error) {
	if req.Report == nil && req.Reporter != nil {
		rep := req.Reporter.Report() // the record carries it
		req.Report = &rep
	}
	d, err := l.admitOnce(ctx, req, units)
	if err != nil || d.unseeded == nil {
		return d, err
	}
	return l.admitSeeded(ctx, req, units, d)
}

// admitOnce admits req with admit.lua, in a call of its own or batched
// with concurrent admissions of its org (admitbatch.go).
func (l *Limiter) admitOnce(ctx context.Context, req Request, units []budget.Unit) (Decision, error) {
	keys := l.callKeys(req.OrgID, req.RequestID, req.Scopes)
	lease := &Lease{
		orgID: req.OrgID, requestID: req.RequestID, keys: keys,
		scopes: append([]Scope(nil), req.Scopes...), est: req.EstTokens, reserved: req.MaxCostMicros,
	}
	for _, s := range req.Scopes {
		if s.Budget != nil || s.TPM > 0 || s.MaxParallel > 0 {
			lease.needs = true
		}
	}
	if lease.needs && req.Report != nil {
		lease.sweep = newSweepState(lease.scopes, *req.Report)
	}
	if p := req.Prefill; p != nil {
		lease.prefillScope = p.Scope + 1
		lease.prefill.Store(p.Tokens)
	}
	j := &admitJob{req: &req, units: units, lease: lease}
	vals, err := l.admits.do(ctx, l, j)
	if err != nil {
		// The call may still run in Redis after its deadline (a frozen or
		// slow server has it queued): the lease lets the caller Settle it
		// with zero usage, which either releases what it took or, settling
		// first, leaves a tombstone that makes the late admission a no-op.
		return Decision{Lease: lease}, fmt.Errorf("limits admit: %w: %w", ErrUnavailable, err)
	}
	return toDecision(vals, req.Scopes, lease)
}

// toDecision maps the result of admit.lua (see its header) to a Decision.
// It is the one place script results become typed decisions.
func toDecision(v []int64, scopes []Scope, lease *Lease) (Decision, error) {
	if len(v) > 15 && v[0] == 2 {
		return unseededDecision(v, scopes)
	}
	if len(v) != 16 {
		return Decision{}, fmt.Errorf("%w: admit returned %d values", ErrUnavailable, len(v))
	}
	d := Decision{
		Epoch: v[1], PrefillInFlight: v[15],
		Headers: RateHeaders{
			LimitRequests: v[8], RemainingRequests: v[9], ResetRequests: time.Duration(v[10]) * time.Millisecond,
			LimitTokens: v[11], RemainingTokens: v[12], ResetTokens: time.Duration(v[13]) * time.Millisecond,
		},
	}
	switch v[0] {
	case 1:
		d.Allowed = true
		d.Lease = lease
		return d, nil
	case -1:
		return Decision{}, fmt.Errorf("admit %s: %w", lease.requestID, ErrDuplicateRequest)
	}
	i := v[2] - 1
	if i < 0 || int(i) >= len(scopes) {
		return Decision{}, fmt.Errorf("%w: admit rejected scope %d of %d", ErrUnavailable, v[2], len(scopes))
	}
	r := &Rejection{
		Scope:       ScopeRef{Kind: scopes[i].Kind, ID: scopes[i].ID},
		RetryAfter:  time.Duration(v[4]) * time.Millisecond,
		SpendMicros: v[5],
		CapMicros:   v[6],
		Quarantined: v[7] == 1,
	}
	switch v[3] {
	case 1:
		r.Limit = LimitRPM
	case 2:
		r.Limit = LimitTPM
	case 3:
		r.Limit = LimitParallel
	case 4:
		r.Limit = LimitBudget
		r.WindowEnd = time.Unix(v[14], 0).UTC()
	case 5:
		r.Limit = LimitPrefill
		r.RetryAfter = PrefillRetryAfter
	default:
		return Decision{}, fmt.Errorf("%w: admit returned limit type %d", ErrUnavailable, v[3])
	}
	if v[4] < 0 {
		r.Never = true
		r.RetryAfter = DefaultRateWindow
	}
	d.Rejection = r
	return d, nil
}

// Renew extends the leases of a live request (call it every RenewInterval
// while a request or stream is alive). If Redis lost the request, Renew
// re-asserts it: that is how live requests get their slots back during the
// quarantine that follows a Redis restart.
func (l *Limiter) Renew(ctx context.Context, lease *Lease) (RenewState, error) {
	if lease.settled.Load() {
		return RenewSettled, nil
	}
	if lease.localHold && l.slices != nil && !lease.localDone.Load() {
		if st := l.slices.renewLocal(lease.local); st != RenewExtended {
			return st, nil
		}
	}
	if lease.promote {
		return l.renewRecord(ctx, lease)
	}
	if !lease.needs {
		return RenewExtended, nil
	}
	if lease.prefillScope > 0 {
		lease.renewMu.Lock()
		defer lease.renewMu.Unlock()
	}
	c := l.renewCall(lease)
	defer c.args.release()
	vals, err := l.run(ctx, renewScript, "renew", c.keys, c.args)
	if err != nil {
		return 0, err
	}
	st, err := renewStates(vals, 1)
	if err != nil {
		return 0, err
	}
	return st[0], nil
}

// maxRenewGroup bounds the requests renewed by one script call.
const maxRenewGroup = 64

// renewCall builds the renew.lua call of leases (one org): their records,
// then each distinct scope's keys once, then the org's lease index when a
// request of the batch is in it.
func (l *Limiter) renewCall(leases ...*Lease) scriptCall {
	first := leases[0]
	keys := make([]string, 0, 2+len(leases)+keysPerScope*len(first.scopes))
	keys = append(keys, first.keys[0])
	indexed := false
	for _, lease := range leases {
		keys = append(keys, lease.keys[1])
		indexed = indexed || lease.sweep != nil
	}
	args := newArgv()
	args.int(ms(l.cfg.LeaseTTL))
	args.int(ms(l.cfg.RecordTTL))
	args.int(ms(l.cfg.rateWindow))
	args.int(ms(l.cfg.rateBucket))
	args.int(int64(len(leases)))
	var distinct map[string]int
	if len(leases) > 1 {
		distinct = make(map[string]int, len(first.scopes))
	}
	for _, lease := range leases {
		args.str(lease.requestID)
		args.int(lease.est)
		args.int(lease.reserved)
		args.bool(lease.sweep != nil)
		lease.sweep.appendNote(args)
		args.int(int64(lease.prefillScope))
		args.int(lease.prefill.Load())
		args.int(int64(len(lease.scopes)))
		for j, s := range lease.scopes {
			hk := lease.keys[2+keysPerScope*j]
			d, ok := distinct[hk]
			if !ok {
				keys = append(keys, hk, lease.keys[3+keysPerScope*j])
				d = (len(keys) - 1 - len(leases)) / keysPerScope
				if distinct != nil {
					distinct[hk] = d
				}
			}
			args.int(int64(d))
			args.bool(s.TPM > 0)
			args.bool(s.MaxParallel > 0)
			budgetArgs(args, s.Budget, false)
		}
	}
	if indexed {
		keys = append(keys, first.keys[len(first.keys)-1])
	}
	return scriptCall{keys: keys, args: args}
}

// renewStates maps renew.lua's result for n requests.
func renewStates(vals []int64, n int) ([]RenewState, error) {
	if len(vals) != 1+n {
		return nil, fmt.Errorf("%w: renew returned %d values for %d requests", ErrUnavailable, len(vals), n)
	}
	out := make([]RenewState, n)
	for i, v := range vals[1:] {
		if v < 0 || v > 3 {
			return nil, fmt.Errorf("%w: renew returned state %d", ErrUnavailable, v)
		}
		out[i] = RenewState(v)
	}
	return out, nil
}

// RenewItem is one renewal of a batch: a lease, and the report that
// replaces its request's (RenewReport) when Report is set.
type RenewItem struct {
	Lease  *Lease
	Report *Report
}

// RenewBatch renews several leases (as Renew, or RenewReport for items
// with a Report): the plain renewals of one org in one renew.lua call (up
// to maxRenewGroup; the leases of a scope they share are pushed with one
// ZADD), the calls of several orgs pipelined in one round trip; the
// others (quota slices' local parts, prefill accounting) as Renew does.
// Results and errors are per item.
func (l *Limiter) RenewBatch(ctx context.Context, items []RenewItem) ([]RenewState, []error) {
	states := make([]RenewState, len(items))
	errs := make([]error, len(items))
	// Groups of plain renewals by org (their epoch key), in order of first
	// appearance: one renew.lua call each.
	var groups [][]int
	byOrg := map[string]int{}
	var wg sync.WaitGroup
	for i, it := range items {
		lease := it.Lease
		if it.Report != nil && lease.sweep != nil {
			lease.sweep.setReport(*it.Report)
		}
		switch {
		case lease.settled.Load():
			states[i] = RenewSettled
		case lease.localHold || lease.promote || lease.prefillScope > 0:
			wg.Add(1)
			go func() {
				defer wg.Done()
				states[i], errs[i] = l.Renew(ctx, lease)
			}()
		case !lease.needs:
			states[i] = RenewExtended
		default:
			g, ok := byOrg[lease.keys[0]]
			if !ok || len(groups[g]) == maxRenewGroup || l.cfg.renewUnbatched {
				g = len(groups)
				groups = append(groups, nil)
				byOrg[lease.keys[0]] = g
			}
			groups[g] = append(groups[g], i)
		}
	}
	if len(groups) > 0 {
		calls := make([]scriptCall, len(groups))
		n := 0
		leases := make([]*Lease, 0, maxRenewGroup)
		for g, idx := range groups {
			leases = leases[:0]
			for _, i := range idx {
				leases = append(leases, items[i].Lease)
			}
			calls[g] = l.renewCall(leases...)
			n += len(idx)
		}
		// One call timeout per 16 renewals, as for settlements.
		cctx, cancel := context.WithTimeout(ctx, l.cfg.CallTimeout*time.Duration(1+n/16))
		vals, verrs := l.store.evalBatch(cctx, renewScript, calls)
		cancel()
		for g, idx := range groups {
			calls[g].args.release()
			err := verrs[g]
			var st []RenewState
			if err == nil {
				st, err = renewStates(vals[g], len(idx))
			}
			for k, i := range idx {
				if err != nil {
					errs[i] = fmt.Errorf("limits renew: %w: %w", ErrUnavailable, err)
					continue
				}
				states[i] = st[k]
			}
		}
	}
	wg.Wait()
	return states, errs
}

// PrefillDone sets the lease's prefill contribution to 0 (its request
// produced its first token) in one renewal call. A failed call is repaired
// by the next renewal, which asserts the contribution again.
func (l *Limiter) PrefillDone(ctx context.Context, lease *Lease) error {
	if lease.prefillScope == 0 || lease.prefill.Swap(0) == 0 {
		return nil
	}
	_, err := l.Renew(ctx, lease)
	return err
}

// SetPrefill replaces the lease's prefill contribution (a correction, e.g.
// from the engine's report of cached prompt tokens) in one renewal call;
// like PrefillDone, a failed call is repaired by the next renewal.
func (l *Limiter) SetPrefill(ctx context.Context, lease *Lease, tokens int64) error {
	if lease.prefillScope == 0 || lease.prefill.Swap(max(tokens, 0)) == max(tokens, 0) {
		return nil
	}
	_, err := l.Renew(ctx, lease)
	return err
}

// Settle releases the request's leases and reconciles tpm (actual −
// estimate) and budgets (actual − reserved), exactly once per request id:
// a second Settle, from this or any data plane, is a no-op. One round trip
// (none when the request only carried rpm limits).
func (l *Limiter) Settle(ctx context.Context, lease *Lease, actualTokens, actualCostMicros int64) (SettleResult, error) {
	return l.SettleOne(ctx, SettleItem{Lease: lease, Tokens: actualTokens, CostMicros: actualCostMicros})
}

// SettleItem is one settlement of a batch. Cancel settles an admission
// whose call failed (see Cancel).
type SettleItem struct {
	Lease              *Lease
	Tokens, CostMicros int64
	Cancel             bool
}

// Cancel settles, with zero usage, an admission whose call returned an
// error but may still run in Redis (MayHaveRun): whichever comes first,
// the admission ends up consuming nothing, its rpm unit included. Unlike
// Settle it runs for leases that hold nothing to settle too.
func (l *Limiter) Cancel(ctx context.Context, lease *Lease) (SettleResult, error) {
	return l.SettleOne(ctx, SettleItem{Lease: lease, Cancel: true})
}

// SettleOne settles one item on its own (Settle or Cancel).
func (l *Limiter) SettleOne(ctx context.Context, it SettleItem) (SettleResult, error) {
	res, errs := l.SettleBatch(ctx, []SettleItem{it})
	return res[0], errs[0]
}

// SettleLocal settles it in process when its lease holds nothing in
// Redis: every limit of the request was admitted from quota slices and
// no renewal wrote its record. ok false: nothing was done (SettleBatch
// settles it); the result is then SettleBatch's for such a lease. It
// never waits for Redis: a renewal writing the lease's record at that
// moment leaves the settlement to SettleBatch.
func (l *Limiter) SettleLocal(it SettleItem) (res SettleResult, ok bool) {
	lease := it.Lease
	if l.slices == nil || lease.local == nil || lease.needs || lease.pwait != nil || lease.settled.Load() {
		return SettleResult{}, false
	}
	if !lease.pmu.TryLock() {
		return SettleResult{}, false // renewRecord is writing the record
	}
	// keys is written by renewRecord under pmu (a data race when it was
	// read before taking it, seen by -race in the e2e tests).
	if lease.keys != nil || lease.recorded.Load() || !lease.localDone.CompareAndSwap(false, true) {
		lease.pmu.Unlock()
		return SettleResult{}, false
	}
	lease.pmu.Unlock()
	al := l.slices.settle(lease.local, it.Tokens, it.CostMicros, it.Cancel)
	lease.settled.Store(true)
	return SettleResult{Applied: true, Alerts: al}, true
}

// maxSettleGroup bounds the requests settled by one script call.
const maxSettleGroup = 64

// SettleBatch settles several requests: the requests of one org in one
// settle.lua call (which reads and writes each scope they share once), the
// calls of several orgs pipelined in one round trip. Results and errors
// are per item; an item that failed can be retried with SettleOne.
func (l *Limiter) SettleBatch(ctx context.Context, items []SettleItem) ([]SettleResult, []error) {
	res := make([]SettleResult, len(items))
	errs := make([]error, len(items))
	// Groups of item indexes by org, in order of first appearance.
	var groups [][]int
	byOrg := map[string]int{}
	var localAlerts map[int][]BudgetAlert
	for i, it := range items {
		if it.Lease.pwait != nil && l.slices != nil && it.Lease.waitDone.CompareAndSwap(false, true) {
			l.slices.unwait(it.Lease.pwait)
		}
		if it.Lease.local != nil && l.slices != nil && it.Lease.settleLocal() {
			if al := l.slices.settle(it.Lease.local, it.Tokens, it.CostMicros, it.Cancel); len(al) > 0 {
				if localAlerts == nil {
					localAlerts = map[int][]BudgetAlert{}
				}
				localAlerts[i] = al
			}
		}
		switch {
		case it.Lease.settled.Load():
			continue
		case !it.Lease.needs && !it.Lease.recorded.Load() && (!it.Cancel || it.Lease.keys == nil):
			it.Lease.settled.Store(true)
			res[i] = SettleResult{Applied: true, Alerts: localAlerts[i]}
			continue
		}
		g, ok := byOrg[it.Lease.orgID]
		if !ok || len(groups[g]) == maxSettleGroup {
			g = len(groups)
			groups = append(groups, nil)
			byOrg[it.Lease.orgID] = g
		}
		groups[g] = append(groups[g], i)
	}
	if len(groups) == 0 {
		return res, errs
	}
	calls := make([]scriptCall, len(groups))
	n := 0
	for g, idx := range groups {
		calls[g] = l.settleCall(items, idx, false)
		n += len(idx)
	}
	// Settlements are off the request path: a batch gets one call timeout
	// per 16 items, so a busy Redis does not fail a large batch whole.
	cctx, cancel := context.WithTimeout(ctx, l.cfg.CallTimeout*time.Duration(1+n/16))
	defer cancel()
	vals, verrs := l.store.evalBatch(cctx, settleScript, calls)
	for _, c := range calls {
		c.args.release()
	}
	for g, idx := range groups {
		err := verrs[g]
		var gres []SettleResult
		if err == nil {
			gres, err = settleResults(items, idx, vals[g])
		}
		for j, i := range idx {
			if err != nil {
				errs[i] = fmt.Errorf("limits settle: %w: %w", ErrUnavailable, err)
				if al := localAlerts[i]; al != nil {
					// The retry (SettleOne) reports them.
					l.slices.requeueAlerts(items[i].Lease.local, al)
				}
				continue
			}
			res[i] = gres[j]
			res[i].Alerts = append(res[i].Alerts, localAlerts[i]...)
			items[i].Lease.settled.Store(true)
		}
	}
	return res, errs
}

// settleCall builds the settle.lua call of items[idx] (one org): their
// records, then each distinct scope's keys once, then the org's lease
// index when a request of the batch is in it (always when sweeping).
func (l *Limiter) settleCall(items []SettleItem, idx []int, sweep bool) scriptCall {
	th := l.cfg.AlertThresholds
	first := items[idx[0]].Lease
	kb := newKeyBuilder(l.cfg.KeyPrefix, first.orgID)
	keys := make([]string, 0, 2+len(idx)+2*len(first.scopes))
	keys = append(keys, kb.epoch())
	indexed := sweep
	for _, i := range idx {
		keys = append(keys, items[i].Lease.keys[1])
		indexed = indexed || items[i].Lease.sweep != nil
	}
	args := newArgv()
	args.int(ms(l.cfg.rateWindow))
	args.int(ms(l.cfg.rateBucket))
	args.int(ms(tombstoneTTL))
	args.int(int64(len(idx)))
	args.int(int64(len(th)))
	args.bool(sweep)
	args.bool(indexed)
	for _, p := range th {
		args.int(p)
	}
	distinct := make(map[string]int, len(first.scopes))
	for _, i := range idx {
		it := items[i]
		lease := it.Lease
		args.str(lease.requestID)
		args.int(max(it.Tokens, 0))
		args.int(max(it.CostMicros, 0))
		args.int(int64(len(lease.scopes)))
		for j, sc := range lease.scopes {
			hk := lease.keys[2+keysPerScope*j]
			d, ok := distinct[hk]
			if !ok {
				keys = append(keys, hk, lease.keys[3+keysPerScope*j])
				d = len(distinct) + 1
				distinct[hk] = d
			}
			args.int(int64(d))
			args.bool(sc.TPM > 0)
			switch {
			case j+1 == lease.prefillScope:
				args.int(2) // leases and the prefill contribution
			default:
				args.bool(sc.MaxParallel > 0)
			}
			args.bool(it.Cancel && sc.RPM > 0)
			budgetArgs(args, sc.Budget, true)
		}
	}
	if indexed {
		keys = append(keys, kb.leaseIndex())
	}
	return scriptCall{keys: keys, args: args}
}

// settleResults maps settle.lua's result (see its header) for items[idx].
func settleResults(items []SettleItem, idx []int, vals []int64) ([]SettleResult, error) {
	out := make([]SettleResult, len(idx))
	j := 1
	for k, i := range idx {
		if j+2 > len(vals) {
			return nil, fmt.Errorf("settle returned %d values for %d requests", len(vals), len(idx))
		}
		state, na := vals[j], vals[j+1]
		j += 2
		if state < 0 || state > 3 || na < 0 || j+3*int(na) > len(vals) {
			return nil, fmt.Errorf("settle returned state %d with %d alerts", state, na)
		}
		res := SettleResult{Applied: state == 1 || state == 2, WithoutRecord: state == 2, Swept: state == 3}
		lease := items[i].Lease
		for ; na > 0; na-- {
			si := vals[j] - 1
			if si < 0 || int(si) >= len(lease.scopes) || lease.scopes[si].Budget == nil {
				return nil, fmt.Errorf("settle alert for scope %d", vals[j])
			}
			sc := lease.scopes[si]
			res.Alerts = append(res.Alerts, BudgetAlert{
				Scope: ScopeRef{Kind: sc.Kind, ID: sc.ID}, Percent: vals[j+1], SpendMicros: vals[j+2],
				CapMicros: sc.Budget.CapMicros, SoftMicros: sc.Budget.SoftMicros, Window: sc.Budget.Window,
			})
			j += 3
		}
		out[k] = res
	}
	if j != len(vals) {
		return nil, fmt.Errorf("settle returned %d values, read %d", len(vals), j)
	}
	return out, nil
}

func int64s(raw []any) ([]int64, error) {
	out := make([]int64, len(raw))
	for i, x := range raw {
		n, ok := x.(int64)
		if !ok {
			return nil, fmt.Errorf("result %d is %T", i, x)
		}
		out[i] = n
	}
	return out, nil
}

// budgetArgs appends a scope's budget ARGV for renew.lua (unit, n) or
// settle.lua (unit, n, cap, soft).
func budgetArgs(a *argv, b *Budget, withCaps bool) {
	if b == nil {
		a.str("-")
		a.int(0)
		if withCaps {
			a.int(0)
			a.int(0)
		}
		return
	}
	u, _ := budget.ParseWindow(b.Window) // validated by Admit
	a.str(u.Unit)
	a.int(u.N)
	if withCaps {
		a.int(b.CapMicros)
		a.int(b.SoftMicros)
	}
}

// run runs a script under the per-call timeout and returns its integer
// array; every failure is ErrUnavailable.
func (l *Limiter) run(ctx context.Context, s *script, op string, keys []string, args *argv) ([]int64, error) {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.CallTimeout)
	defer cancel()
	out, err := l.store.eval(ctx, s, scriptCall{keys: keys, args: args})
	if err != nil {
		return nil, fmt.Errorf("limits %s: %w: %w", op, ErrUnavailable, err)
	}
	return out, nil
}

// MayHaveRun reports whether a failed call might still execute in Redis:
// false only when the connection could not even be made.
func MayHaveRun(err error) bool {
	var de *redispipe.DialError
	if errors.As(err, &de) {
		return false
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return false
	}
	return !errors.Is(err, syscall.ECONNREFUSED)
}

// String returns a scope reference as "kind:id".
func (r ScopeRef) String() string { return r.Kind + ":" + r.ID }

// RetryAfterSeconds returns the retry-after header value: the wait rounded
// up to whole seconds, at least 1.
func (r *Rejection) RetryAfterSeconds() string {
	s := (r.RetryAfter + time.Second - 1) / time.Second
	return strconv.FormatInt(max(int64(s), 1), 10)
}
