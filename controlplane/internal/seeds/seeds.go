// Package seeds answers the data planes' budget seed requests (SPEC §8.3:
// "a Redis restart does not reset budgets"; docs/alerts.md).
//
// A data plane whose Redis does not hold a budgeted scope's window (first
// use, Redis lost its state) admits nothing on that scope until it has
// written the ledger's current spend of the window into Redis. It asks over
// core NATS request/reply (wire.BudgetSeedSubject); every control-plane
// replica runs a Responder in the queue group wire.BudgetSeedQueue, so
// one of them answers each request.
//
// "Current" includes the usage events still in the SLUICE_USAGE stream:
// before it reads Postgres, the responder samples the stream's last
// sequence and waits (bounded) until the ledger's durable consumer has
// recorded everything up to it — its ack floor has reached that sequence,
// or nothing is pending or unacknowledged — because the ledger
// acknowledges a usage event only after its transaction commits. Every
// request that had finished (and whose event was published) when the seed
// request arrived is therefore in the answer. The wait is what the ledger
// consumer takes to fetch and commit a batch: usually well under its 1 s
// batch wait. One poller, shared by every waiting request, reads the
// consumer's state. When Postgres is down, or the ledger does not catch up
// within the wait, the reply is an error and the data plane keeps the
// scope closed (503 limits_recovering).
package seeds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/budget"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// Defaults of Config.
const (
	// DefaultMaxWait bounds one answer: the wait for the ledger and the
	// Postgres queries. A request that names a shorter wait (wait_ms) gets
	// 90 % of it, so the reply arrives before its requester gives up.
	DefaultMaxWait = 2 * time.Second
	// DefaultPollInterval is how often the shared poller reads the ledger
	// consumer's state while requests wait.
	DefaultPollInterval = 20 * time.Millisecond
	// DefaultConcurrency bounds the requests answered at once; more wait in
	// the subscription's buffer.
	DefaultConcurrency = 64
	// MaxScopes bounds the scopes of one request (a request has one per
	// budgeted level it touches, fewer than ten).
	MaxScopes = 256
)

// Config configures a Responder; zero values take the defaults.
type Config struct {
	// Durable is the ledger's durable consumer on SLUICE_USAGE (package
	// spend's DefaultDurable), whose progress the answers wait for.
	Durable      string
	MaxWait      time.Duration
	PollInterval time.Duration
	Concurrency  int
	Logger       *slog.Logger
}

// Stats are the responder's counters since start.
type Stats struct {
	// Answered counts requests answered with seeds; Failed those answered
	// with an error (invalid request, Postgres down, ledger behind).
	Answered, Failed int64
}

// Responder answers budget seed requests.
type Responder struct {
	cfg Config
	st  *store.Store
	nc  *nats.Conn
	js  jetstream.JetStream
	log *slog.Logger
	wm  watermark

	answered, failed atomic.Int64
}

// New returns a responder answering through nc from st.
func New(cfg Config, st *store.Store, nc *nats.Conn) (*Responder, error) {
	if cfg.Durable == "" {
		return nil, errors.New("seeds: the ledger's durable consumer name is required")
	}
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = DefaultMaxWait
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	r := &Responder{cfg: cfg, st: st, nc: nc, js: js, log: cfg.Logger.With("component", "budget-seeds")}
	r.wm = watermark{poll: r.recorded, interval: cfg.PollInterval, changed: make(chan struct{})}
	return r, nil
}

// Stats returns the counters.
func (r *Responder) Stats() Stats {
	return Stats{Answered: r.answered.Load(), Failed: r.failed.Load()}
}

// Run answers requests until ctx is done, then waits for the answers in
// progress.
func (r *Responder) Run(ctx context.Context) error {
	sem := make(chan struct{}, r.cfg.Concurrency)
	var (
		mu     sync.Mutex
		closed bool
		wg     sync.WaitGroup
	)
	r.wm.ctx = ctx
	sub, err := r.nc.QueueSubscribe(wire.BudgetSeedSubject, wire.BudgetSeedQueue, func(m *nats.Msg) {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		mu.Lock()
		if closed {
			mu.Unlock()
			<-sem
			return
		}
		wg.Add(1)
		mu.Unlock()
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			r.handle(ctx, m)
		}()
	})
	if err != nil {
		return fmt.Errorf("subscribe to %s: %w", wire.BudgetSeedSubject, err)
	}
	r.log.Info("answering budget seed requests", "subject", wire.BudgetSeedSubject)
	<-ctx.Done()
	_ = sub.Unsubscribe()
	mu.Lock()
	closed = true
	mu.Unlock()
	wg.Wait()
	return nil
}

// handle answers one request.
func (r *Responder) handle(ctx context.Context, m *nats.Msg) {
	start := time.Now()
	rep := &configv1.BudgetSeedReply{}
	var req configv1.BudgetSeedRequest
	if err := wire.Unmarshal(m.Data, &req); err != nil {
		rep.Error = "the request does not decode"
	} else if seeds, err := r.Answer(ctx, &req); err != nil {
		rep.Error = err.Error()
	} else {
		rep.Seeds = seeds
	}
	if rep.Error != "" {
		r.failed.Add(1)
		r.log.Warn("budget seed request refused", "org_id", req.GetOrgId(), "scopes", len(req.GetScopes()),
			"error", rep.Error, "duration_ms", time.Since(start).Milliseconds())
	} else {
		r.answered.Add(1)
		r.log.Debug("budget seeds answered", "org_id", req.GetOrgId(), "scopes", len(req.GetScopes()),
			"duration_ms", time.Since(start).Milliseconds())
	}
	data, err := wire.Marshal(rep)
	if err == nil {
		err = m.Respond(data)
	}
	if err != nil {
		r.log.Warn("budget seed reply not sent", "org_id", req.GetOrgId(), "error", err)
	}
}

// Errors of Answer, as the data planes see them (the causes are logged).
var (
	errLedgerDown   = errors.New("the ledger (Postgres) is unavailable")
	errLedgerBehind = errors.New("the ledger has not recorded the usage stream within the wait")
)

// Answer computes the seeds of req: each scope with the ledger's spend of
// its window, once the ledger has recorded every usage event the stream
// held when Answer started.
func (r *Responder) Answer(ctx context.Context, req *configv1.BudgetSeedRequest) ([]*configv1.BudgetSeed, error) {
	wait := r.cfg.MaxWait
	if w := time.Duration(req.GetWaitMs()) * time.Millisecond; w > 0 {
		wait = min(wait, w*9/10)
	}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	scopes, err := r.plan(ctx, req)
	if err != nil {
		return nil, err
	}
	last, err := r.streamLast(ctx)
	if err != nil {
		r.log.Warn("usage stream state unavailable", "error", err)
		return nil, errLedgerBehind
	}
	if last > 0 {
		if err := r.wm.wait(ctx, last); err != nil {
			r.wm.mu.Lock()
			floor := r.wm.floor
			r.wm.mu.Unlock()
			r.log.Warn("ledger behind the usage stream", "stream_seq", last, "recorded_seq", floor, "error", err)
			return nil, fmt.Errorf("%w (stream sequence %d)", errLedgerBehind, last)
		}
	}
	spend, err := r.st.BudgetSpend(ctx, scopes)
	if err != nil {
		r.log.Warn("ledger spend unavailable", "error", err)
		return nil, errLedgerDown
	}
	out := make([]*configv1.BudgetSeed, len(scopes))
	for i, q := range req.GetScopes() {
		out[i] = &configv1.BudgetSeed{OrgId: req.GetOrgId(), Kind: q.GetKind(), Id: q.GetId(), Window: q.GetWindow(),
			WindowStart: q.GetWindowStart(), SpendMicros: budget.Micros(spend[i])}
	}
	return out, nil
}

// plan validates req and maps each scope to the ledger columns its spend
// is summed over (store.BudgetScope).
func (r *Responder) plan(ctx context.Context, req *configv1.BudgetSeedRequest) ([]store.BudgetScope, error) {
	org := req.GetOrgId()
	n := len(req.GetScopes())
	switch {
	case org == "":
		return nil, errors.New("org_id is empty")
	case n == 0 || n > MaxScopes:
		return nil, fmt.Errorf("%d scopes: want 1 to %d", n, MaxScopes)
	}
	out := make([]store.BudgetScope, n)
	for i, q := range req.GetScopes() {
		if q.GetOrgId() != "" && q.GetOrgId() != org {
			return nil, fmt.Errorf("scope %d: org %q is not the request's", i, q.GetOrgId())
		}
		start, end, err := budget.Window(q.GetWindow(), time.Unix(q.GetWindowStart(), 0))
		if err != nil {
			return nil, fmt.Errorf("scope %d: %w", i, err)
		}
		if start.Unix() != q.GetWindowStart() {
			return nil, fmt.Errorf("scope %d: %d is not the start of a %s window", i, q.GetWindowStart(), q.GetWindow())
		}
		sc := store.BudgetScope{Kind: q.GetKind(), OrgID: org, Start: start, End: end}
		id := q.GetId()
		owner, group, composite := strings.Cut(id, "/")
		switch q.GetKind() {
		case budget.KindKey:
			sc.KeyID = id
		case budget.KindUser:
			sc.UserID = id
		case budget.KindTeam:
			sc.TeamID = id
		case budget.KindOrg:
			if id != org {
				return nil, fmt.Errorf("scope %d: org scope %q of org %q", i, id, org)
			}
		case budget.KindMember:
			sc.TeamID, sc.UserID = owner, group
		case budget.KindKeyModel:
			sc.KeyID, sc.ModelGroup = owner, group
		case budget.KindTeamModel:
			sc.TeamID, sc.ModelGroup = owner, group
		case budget.KindCustomer:
			cu, err := r.st.CustomerGet(ctx, store.Tenant{OrgID: org}, id)
			if errors.Is(err, store.ErrNotFound) {
				return nil, fmt.Errorf("scope %d: no customer %q in org %q", i, id, org)
			}
			if err != nil {
				r.log.Warn("customer lookup failed", "error", err)
				return nil, errLedgerDown
			}
			sc.Customer = cu.ExternalID
		case budget.KindProject, budget.KindTag:
			ls, err := r.st.LabelScopeGet(ctx, store.Tenant{OrgID: org}, id)
			if errors.Is(err, store.ErrNotFound) || (err == nil && ls.Kind != q.GetKind()) {
				return nil, fmt.Errorf("scope %d: no %s scope %q in org %q", i, q.GetKind(), id, org)
			}
			if err != nil {
				r.log.Warn("label scope lookup failed", "error", err)
				return nil, errLedgerDown
			}
			sc.Label = ls.Name
		default:
			return nil, fmt.Errorf("scope %d: kind %q has no budget", i, q.GetKind())
		}
		composed := q.GetKind() == budget.KindMember || q.GetKind() == budget.KindKeyModel || q.GetKind() == budget.KindTeamModel
		if id == "" || (composed && (!composite || owner == "" || group == "")) {
			return nil, fmt.Errorf("scope %d: id %q of kind %s", i, id, q.GetKind())
		}
		out[i] = sc
	}
	return out, nil
}

// streamLast returns the usage stream's last sequence (0 when the stream
// does not exist yet: nothing was ever published).
func (r *Responder) streamLast(ctx context.Context) (uint64, error) {
	s, err := r.js.Stream(ctx, wire.UsageStream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	return s.CachedInfo().State.LastSeq, nil
}

// recorded returns the stream sequence up to which the ledger has recorded
// every usage event: its durable consumer's ack floor, or "everything"
// when nothing is pending or unacknowledged.
func (r *Responder) recorded(ctx context.Context) (uint64, error) {
	c, err := r.js.Consumer(ctx, wire.UsageStream, r.cfg.Durable)
	if err != nil {
		return 0, err
	}
	info := c.CachedInfo()
	if info.NumPending == 0 && info.NumAckPending == 0 {
		return math.MaxUint64, nil
	}
	return info.AckFloor.Stream, nil
}

// watermark shares one poller of the ledger's progress among the requests
// waiting for it. A waiter only trusts polls that started after it began
// waiting: an older "nothing pending" says nothing about events published
// since.
type watermark struct {
	ctx      context.Context // the Responder's Run context
	poll     func(context.Context) (uint64, error)
	interval time.Duration

	mu      sync.Mutex
	started uint64 // polls started
	doneGen uint64 // the start number of the last finished poll
	floor   uint64 // its result
	err     error
	waiters int
	running bool
	changed chan struct{} // closed when a poll finishes
}

// wait returns once the ledger has recorded everything up to seq, or
// ctx's error (with the last poll's error, if any).
func (w *watermark) wait(ctx context.Context, seq uint64) error {
	w.mu.Lock()
	w.waiters++
	after := w.started
	if !w.running {
		w.running = true
		go w.run()
	}
	defer func() {
		w.mu.Lock()
		w.waiters--
		w.mu.Unlock()
	}()
	for {
		if w.doneGen > after && w.err == nil && w.floor >= seq {
			w.mu.Unlock()
			return nil
		}
		ch, lastErr := w.changed, w.err
		w.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			if lastErr != nil {
				return fmt.Errorf("%w (ledger consumer: %w)", ctx.Err(), lastErr)
			}
			return ctx.Err()
		}
		w.mu.Lock()
	}
}

// run polls while anyone waits.
func (w *watermark) run() {
	ctx := w.ctx
	if ctx == nil {
		ctx = context.Background()
	}
	for {
		w.mu.Lock()
		if w.waiters == 0 || ctx.Err() != nil {
			w.running = false
			w.mu.Unlock()
			return
		}
		w.started++
		gen := w.started
		w.mu.Unlock()
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		floor, err := w.poll(pctx)
		cancel()
		w.mu.Lock()
		w.doneGen, w.floor, w.err = gen, floor, err
		close(w.changed)
		w.changed = make(chan struct{})
		w.mu.Unlock()
		select {
		case <-ctx.Done():
		case <-time.After(w.interval):
		}
	}
}
