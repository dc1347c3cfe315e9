// Package publish distributes configuration to the data planes over NATS
// JetStream (SPEC §6).
//
// One control-plane replica at a time leads (a Postgres advisory lock held
// on a dedicated connection). The leader:
//
//   - reads the outbox in commit order and appends each change, as a
//     state-carrying Event, to the stream of every region that should get
//     it: every region for security events (blocks, deletions, rotations
//     without grace), auto regions for everything else. Appends carry a
//     dedupe id and an expected-last-sequence check, so a region's stream
//     sequence is its region_seq and a second publisher can neither
//     duplicate nor reorder an event;
//   - compiles full snapshots after changes (debounced) into the object
//     store, records each region's stream position at compile time, and
//     points each region's KV entry at the version it should run;
//   - creates the streams data planes publish into: SLUICE_USAGE (usage
//     events) and SLUICE_ALERTS (budget alerts).
//
// Every replica publishes liveness ticks and records data-plane heartbeats.
package publish

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Defaults.
const (
	DefaultDebounce     = 150 * time.Millisecond
	DefaultMaxDelay     = 2 * time.Second
	DefaultPollInterval = 500 * time.Millisecond
	DefaultTickInterval = time.Second
	// DefaultSnapshotInterval bounds the age of the newest snapshot.
	DefaultSnapshotInterval = 15 * time.Minute
	DefaultStreamMaxAge     = 7 * 24 * time.Hour
	DefaultDuplicateWindow  = 2 * time.Minute
	// UsageStreamMaxAge is how long usage events wait in SLUICE_USAGE for
	// the spend consumer: the longest Postgres outage the ledger survives.
	UsageStreamMaxAge = 7 * 24 * time.Hour
	// UsageDuplicateWindow is how long JetStream remembers a usage event's
	// request id to drop republished copies (the consumer is idempotent
	// beyond it).
	UsageDuplicateWindow = 10 * time.Minute
	// AlertStreamMaxAge is how long budget alerts wait in SLUICE_ALERTS
	// for the alert consumer (as for usage: the longest Postgres outage
	// that loses no alert).
	AlertStreamMaxAge = 7 * 24 * time.Hour
	// AlertDuplicateWindow is how long JetStream remembers an alert id;
	// the ledger's unique alert_id drops later copies.
	AlertDuplicateWindow = 2 * time.Minute
	batchSize            = 500
	// publishTimeout bounds one event append, so a NATS outage ends a
	// publishing round quickly instead of stalling it.
	publishTimeout = 500 * time.Millisecond
	// leaderLockID is the advisory lock of the publishing leader.
	leaderLockID = 0x736c7569636532
)

// Config configures the publisher.
type Config struct {
	// InstanceID names this control-plane replica in ticks and logs.
	InstanceID string
	// Debounce is how long after a change a snapshot is compiled (more
	// changes within it are folded in), up to MaxDelay after the first.
	Debounce time.Duration
	MaxDelay time.Duration
	// SnapshotInterval compiles a fresh snapshot at least this often even
	// without changes, so a data plane never replays a long event history
	// and expired grace hashes leave the snapshot (default 15 min).
	SnapshotInterval time.Duration
	// PollInterval bounds how long a change waits if a notification is
	// lost.
	PollInterval time.Duration
	// TickInterval is the liveness tick period.
	TickInterval time.Duration
	// StreamMaxAge bounds how long region events are kept: a data plane
	// (or a rollback) can replay at most this far back.
	StreamMaxAge time.Duration
	// Replicas is the JetStream replica count of streams and buckets.
	Replicas int
	// OnHeartbeat records a data-plane heartbeat (nil: ignored).
	OnHeartbeat func(ctx context.Context, hb *configv1.Heartbeat) error
	Logger      *slog.Logger
	// Now is the clock of snapshot compilation, the snapshot's created_at
	// (nil: time.Now).
	Now func() time.Time
}

func (c *Config) defaults() {
	if c.Debounce == 0 {
		c.Debounce = DefaultDebounce
	}
	if c.MaxDelay == 0 {
		c.MaxDelay = DefaultMaxDelay
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.SnapshotInterval == 0 {
		c.SnapshotInterval = DefaultSnapshotInterval
	}
	if c.TickInterval == 0 {
		c.TickInterval = DefaultTickInterval
	}
	if c.StreamMaxAge == 0 {
		c.StreamMaxAge = DefaultStreamMaxAge
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
}

// Publisher runs the distribution side of the control plane.
type Publisher struct {
	cfg   Config
	store *store.Store
	pool  *pgxpool.Pool
	nc    *nats.Conn
	js    jetstream.JetStream
	log   *slog.Logger

	eventsPublished, compiles, compileErrors, heartbeats, epochs atomic.Int64
	lastVersion                                                  atomic.Int64
	lastCompileNanos                                             atomic.Int64
	lastSnapshotBytes                                            atomic.Int64

	mu       sync.Mutex
	leader   bool
	pointers map[string]*configv1.SnapshotPointer // last written per region

	// fleet is the highest numbers data planes reported running (epoch.go);
	// fleetRaised wakes the leader when one of them grows.
	fleetMu     sync.Mutex
	fleet       fleetSeen
	fleetRaised chan struct{}
	// epochFloor is the current epoch's version floor: heartbeats of data
	// planes running versions up to it tell nothing about this history.
	epochFloor atomic.Int64
}

// New returns a publisher. nc must stay open while Run runs.
func New(cfg Config, st *store.Store, pool *pgxpool.Pool, nc *nats.Conn) (*Publisher, error) {
	cfg.defaults()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &Publisher{cfg: cfg, store: st, pool: pool, nc: nc, js: js, log: cfg.Logger, pointers: map[string]*configv1.SnapshotPointer{},
		fleet: fleetSeen{regionSeq: map[string]uint64{}, regionFrom: map[string]string{}}, fleetRaised: make(chan struct{}, 1)}, nil
}

// Stats are the publisher's counters for metrics.
type Stats struct {
	Leader            bool
	EventsPublished   int64 // region events appended (one per region per change)
	Compiles          int64
	CompileErrors     int64
	Heartbeats        int64 // data-plane heartbeats recorded
	LastVersion       int64 // last snapshot version compiled here
	LastCompile       time.Duration
	LastSnapshotBytes int64
	// EpochsStarted counts distribution epochs this replica started
	// (JetStream found ahead of the database; epoch.go).
	EpochsStarted int64
}

// Stats returns the counters.
func (p *Publisher) Stats() Stats {
	return Stats{Leader: p.IsLeader(), EventsPublished: p.eventsPublished.Load(), Compiles: p.compiles.Load(),
		CompileErrors: p.compileErrors.Load(), Heartbeats: p.heartbeats.Load(), LastVersion: p.lastVersion.Load(),
		LastCompile: time.Duration(p.lastCompileNanos.Load()), LastSnapshotBytes: p.lastSnapshotBytes.Load(), EpochsStarted: p.epochs.Load()}
}

// Run publishes until ctx is done. Its parts (liveness ticks, heartbeat
// recording, the leadership loop) run under one errgroup: a part that
// cannot run (the heartbeat subscription refused) stops Run with its
// error. Losing leadership is not an error: Run tries again.
func (p *Publisher) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { p.tickLoop(ctx); return nil })
	g.Go(func() error { return p.heartbeatLoop(ctx) })
	g.Go(func() error { p.leadLoop(ctx); return nil })
	return g.Wait()
}
