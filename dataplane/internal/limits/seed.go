package limits

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sluicegw/sluice/internal/budget"
)

// Budget seeds (SPEC §8.3: "a Redis restart does not reset budgets").
//
// A budget window lives in its scope's state hash (fields bw, bs). When
// admit.lua finds a budgeted scope without a window of its duration — first
// use, Redis lost its state, the state expired, or budget_duration changed —
// only the ledger knows the spend, so it answers "needs seed" and consumes
// nothing. Admit then asks Config.Seeds (the control plane, over NATS) for
// the ledger's current spend of those windows, writes each with seed.lua
// (which only starts a window that is still missing, never overwriting one)
// and admits again, all within Config.SeedWait; past it, or when the
// source fails, the request is rejected with Rejection.Unseeded (the proxy
// answers 503 limits_recovering). Concurrent admissions of one scope share
// one seed request. A window that follows an older one of an intact state
// starts at zero without a seed (lua/common.lua, budget_held, says why).

// DefaultSeedWait bounds how long one Admit waits for the seeds of its
// missing budget windows: the control plane answers once its ledger has
// recorded every usage event published before the request, which takes up
// to the ledger consumer's batch wait (about a second).
const DefaultSeedWait = 2 * time.Second

// maxSeedRounds bounds the seed-and-admit rounds of one Admit: a second
// round only happens when a window ended between the seed and its write.
const maxSeedRounds = 3

// SeedNeed names a budget window Redis does not hold.
type SeedNeed struct {
	Scope ScopeRef
	// Window is the scope's budget_duration; WindowStart the Unix second
	// the current window (by Redis's clock) starts at.
	Window      string
	WindowStart int64
}

// SeedFunc returns the ledger's current spend, in micro-USD, of each
// window of needs (all of orgID), in order: every request recorded or
// still on its way in the usage stream. It must return an error rather
// than a guess; ctx carries the deadline.
type SeedFunc func(ctx context.Context, orgID string, needs []SeedNeed) ([]int64, error)

// ErrNoSeedSource is the Cause of an Unseeded rejection by a Limiter
// without Config.Seeds.
var ErrNoSeedSource = errors.New("no budget seed source configured")

// seedKey identifies one window's seed flight.
type seedKey struct {
	org, kind, id, window string
	start                 int64
}

// seedFlight is one seed request in progress; done closes when it ends.
type seedFlight struct {
	done chan struct{}
	err  error
	// waiters counts the admissions that joined the flight (under
	// seedFlights.mu; read by tests).
	waiters int
}

// seedFlights are the seed requests in flight, shared by concurrent
// admissions of the same windows.
type seedFlights struct {
	mu sync.Mutex
	m  map[seedKey]*seedFlight
}

// unseededDecision maps admit.lua's "needs seed" answer (see its header).
func unseededDecision(v []int64, scopes []Scope) (Decision, error) {
	k := int(v[2])
	if k <= 0 || len(v) != 15+2*k {
		return Decision{}, fmt.Errorf("%w: admit returned %d values for %d unseeded scopes", ErrUnavailable, len(v), k)
	}
	d := Decision{Epoch: v[1], unseeded: make([]SeedNeed, 0, k)}
	for j := 15; j < len(v); j += 2 {
		i := v[j] - 1
		if i < 0 || int(i) >= len(scopes) || scopes[i].Budget == nil {
			return Decision{}, fmt.Errorf("%w: admit asked a seed for scope %d of %d", ErrUnavailable, v[j], len(scopes))
		}
		s := scopes[i]
		d.unseeded = append(d.unseeded, SeedNeed{Scope: ScopeRef{Kind: s.Kind, ID: s.ID}, Window: s.Budget.Window, WindowStart: v[j+1]})
	}
	return d, nil
}

// admitSeeded seeds the windows d (an answer "needs seed") names and
// admits req again, for up to Config.SeedWait.
func (l *Limiter) admitSeeded(ctx context.Context, req Request, units []budget.Unit, d Decision) (Decision, error) {
	wctx, cancel := context.WithTimeout(ctx, l.cfg.SeedWait)
	defer cancel()
	for range maxSeedRounds {
		if err := l.seed(wctx, req.OrgID, d.unseeded); err != nil {
			return unseededRejection(d, err), nil
		}
		next, err := l.admitOnce(ctx, req, units)
		if err != nil || next.unseeded == nil {
			return next, err
		}
		d = next
	}
	return unseededRejection(d, errors.New("the budget window kept moving while it was seeded")), nil
}

// unseededRejection rejects a request whose budget windows could not be
// seeded, naming the first of them.
func unseededRejection(d Decision, cause error) Decision {
	n := d.unseeded[0]
	return Decision{Epoch: d.Epoch, Rejection: &Rejection{
		Scope: n.Scope, Limit: LimitBudget, Unseeded: true, Cause: cause, RetryAfter: time.Second,
	}}
}

// seed makes sure every window of needs was seeded: it asks the source
// for the windows no other admission is seeding already and writes them,
// then waits for the others' flights. Flights are not cancelled by the
// caller that started them (others may wait on them); they are bounded by
// ctx's deadline.
func (l *Limiter) seed(ctx context.Context, org string, needs []SeedNeed) error {
	if l.cfg.Seeds == nil {
		return ErrNoSeedSource
	}
	var mine []SeedNeed
	var mineKeys []seedKey
	var mineFlights, others []*seedFlight
	f := &l.flights
	f.mu.Lock()
	if f.m == nil {
		f.m = map[seedKey]*seedFlight{}
	}
	for _, n := range needs {
		k := seedKey{org: org, kind: n.Scope.Kind, id: n.Scope.ID, window: n.Window, start: n.WindowStart}
		if fl, ok := f.m[k]; ok {
			fl.waiters++
			others = append(others, fl)
			continue
		}
		fl := &seedFlight{done: make(chan struct{})}
		f.m[k] = fl
		mine, mineKeys, mineFlights = append(mine, n), append(mineKeys, k), append(mineFlights, fl)
	}
	f.mu.Unlock()
	var err error
	if len(mine) > 0 {
		fctx := context.WithoutCancel(ctx)
		if dl, ok := ctx.Deadline(); ok {
			var cancel context.CancelFunc
			fctx, cancel = context.WithDeadline(fctx, dl)
			defer cancel()
		}
		err = l.fetchSeeds(fctx, org, mine)
		f.mu.Lock()
		for i, fl := range mineFlights {
			fl.err = err
			delete(f.m, mineKeys[i])
			close(fl.done)
		}
		f.mu.Unlock()
	}
	for _, fl := range others {
		if err != nil {
			break
		}
		select {
		case <-fl.done:
			err = fl.err
		case <-ctx.Done():
			err = fmt.Errorf("waiting for a budget seed: %w", ctx.Err())
		}
	}
	return err
}

// fetchSeeds asks the source for the spend of needs and writes the seeds.
func (l *Limiter) fetchSeeds(ctx context.Context, org string, needs []SeedNeed) error {
	spend, err := l.cfg.Seeds(ctx, org, needs)
	if err != nil {
		return fmt.Errorf("budget seeds: %w", err)
	}
	if len(spend) != len(needs) {
		return fmt.Errorf("budget seeds: %d answers for %d windows", len(spend), len(needs))
	}
	seeds := make([]Seed, len(needs))
	for i, n := range needs {
		if spend[i] < 0 {
			return fmt.Errorf("budget seeds: negative spend %d for %s", spend[i], n.Scope)
		}
		seeds[i] = Seed{Scope: n.Scope, Window: n.Window, WindowStart: n.WindowStart, SpendMicros: spend[i]}
	}
	// The seeds stay valid while the write is retried: a Redis that just
	// restarted may miss one call's deadline.
	for attempt := 1; ; attempt++ {
		_, err = l.WriteSeeds(ctx, org, seeds)
		if err == nil && l.slices != nil {
			l.slices.seeded(org, needs)
		}
		if err == nil || attempt == maxSeedWrites || !errors.Is(err, ErrUnavailable) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(seedWriteBackoff):
		}
	}
}

// maxSeedWrites and seedWriteBackoff bound the retries of a failed seed
// write (within Config.SeedWait).
const (
	maxSeedWrites    = 3
	seedWriteBackoff = 20 * time.Millisecond
)

// Seed is the ledger's spend of one budget window.
type Seed struct {
	Scope       ScopeRef
	Window      string // budget_duration
	WindowStart int64  // Unix s
	SpendMicros int64
}

// Seed outcomes of WriteSeeds.
const (
	// SeedStale: the seed's window is not the current one (it ended);
	// nothing was written.
	SeedStale = -1
	// SeedNotNeeded: the scope holds a window already (another data plane
	// seeded it first, or it is an older window of an intact state);
	// nothing was written.
	SeedNotNeeded = 0
	// SeedWritten: the window was missing and now starts at the seed (plus
	// the reservations of running requests re-asserted meanwhile).
	SeedWritten = 1
)

// WriteSeeds starts the missing budget windows of seeds (all of orgID)
// from their spend, in one call of seed.lua, and returns each seed's
// outcome (SeedStale, SeedNotNeeded, SeedWritten). It never overwrites a
// window Redis holds.
func (l *Limiter) WriteSeeds(ctx context.Context, orgID string, seeds []Seed) ([]int64, error) {
	if !validTagPart(orgID) {
		return nil, fmt.Errorf("%w: org id %q", ErrInvalidRequest, orgID)
	}
	if len(seeds) == 0 {
		return nil, nil
	}
	kb := newKeyBuilder(l.cfg.KeyPrefix, orgID)
	keys := make([]string, 0, len(seeds))
	args := newArgv()
	defer args.release()
	args.int(int64(len(seeds)))
	for _, s := range seeds {
		u, err := budget.ParseWindow(s.Window)
		if err != nil || !validKinds[s.Scope.Kind] || s.Scope.ID == "" || s.SpendMicros < 0 {
			return nil, fmt.Errorf("%w: seed %s window %q spend %d", ErrInvalidRequest, s.Scope, s.Window, s.SpendMicros)
		}
		keys = append(keys, kb.scope(&Scope{Kind: s.Scope.Kind, ID: s.Scope.ID})[0])
		args.str(u.Unit)
		args.int(u.N)
		args.int(s.WindowStart)
		args.int(s.SpendMicros)
	}
	vals, err := l.run(ctx, seedScript, "seed", keys, args)
	if err != nil {
		return nil, err
	}
	if len(vals) != len(seeds) {
		return nil, fmt.Errorf("%w: seed returned %d values for %d seeds", ErrUnavailable, len(vals), len(seeds))
	}
	return vals, nil
}
