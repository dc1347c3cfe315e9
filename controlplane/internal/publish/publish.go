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
//     points each region's KV entry at the version it should run. A
//     snapshot carries the ledger spend of every budgeted scope in its
//     current window (budget seeds, seeds.go), as fresh as the compile;
//   - creates the streams data planes publish into: SLUICE_USAGE (usage
//     events) and SLUICE_ALERTS (budget alerts).
//
// Every replica publishes liveness ticks and records data-plane heartbeats.
package publish

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
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
	// Now is the clock of snapshot compilation: the snapshot's created_at
	// and the budget windows its seeds are summed for (nil: time.Now).
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

	eventsPublished, compiles, compileErrors, heartbeats atomic.Int64
	lastVersion                                          atomic.Int64
	lastCompileNanos                                     atomic.Int64
	lastSnapshotBytes                                    atomic.Int64
	lastBudgetSeeds                                      atomic.Int64

	mu       sync.Mutex
	leader   bool
	pointers map[string]*configv1.SnapshotPointer // last written per region
}

// New returns a publisher. nc must stay open while Run runs.
func New(cfg Config, st *store.Store, pool *pgxpool.Pool, nc *nats.Conn) (*Publisher, error) {
	cfg.defaults()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &Publisher{cfg: cfg, store: st, pool: pool, nc: nc, js: js, log: cfg.Logger, pointers: map[string]*configv1.SnapshotPointer{}}, nil
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
	LastBudgetSeeds   int64 // budget seeds in the last snapshot compiled here
}

// Stats returns the counters.
func (p *Publisher) Stats() Stats {
	return Stats{Leader: p.IsLeader(), EventsPublished: p.eventsPublished.Load(), Compiles: p.compiles.Load(),
		CompileErrors: p.compileErrors.Load(), Heartbeats: p.heartbeats.Load(), LastVersion: p.lastVersion.Load(),
		LastCompile: time.Duration(p.lastCompileNanos.Load()), LastSnapshotBytes: p.lastSnapshotBytes.Load(),
		LastBudgetSeeds: p.lastBudgetSeeds.Load()}
}

// IsLeader reports whether this replica currently publishes.
func (p *Publisher) IsLeader() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.leader
}

func (p *Publisher) setLeader(v bool) {
	p.mu.Lock()
	p.leader = v
	p.mu.Unlock()
}

// Run publishes until ctx is done.
func (p *Publisher) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.tickLoop(ctx) }()
	go func() { defer wg.Done(); p.heartbeatLoop(ctx) }()
	// A NATS outage ends leadership (publishing fails); try again as soon
	// as NATS is back rather than up to a retry interval later, so that
	// changes the outbox held during the outage go out at once.
	reconnected := p.nc.StatusChanged(nats.CONNECTED)
	defer p.nc.RemoveStatusListener(reconnected)
	for ctx.Err() == nil {
		if err := p.lead(ctx); err != nil && ctx.Err() == nil {
			p.log.Warn("publisher leadership ended", "error", err)
		}
		// Connected (another replica leads, or the failure was not NATS):
		// try again soon; disconnected: wait for the reconnect.
		wait := time.Second
		if p.nc.IsConnected() {
			wait = 100 * time.Millisecond
		}
		select {
		case <-ctx.Done():
		case <-reconnected:
		case <-time.After(wait):
		}
	}
	wg.Wait()
	return nil
}

// lead tries to become leader and, if it does, publishes until its lock
// connection fails or ctx is done.
func (p *Publisher) lead(parent context.Context) error {
	if !p.nc.IsConnected() {
		// JetStream calls would only wait out their timeouts; Run retries
		// as soon as the connection is back.
		return errors.New("nats is not connected")
	}
	// Leadership ends the moment NATS disconnects: a JetStream call in
	// flight (a compile, a pointer write) would otherwise wait out its
	// timeout and hold back what the outbox collected meanwhile.
	ctx, endLeadership := context.WithCancel(parent)
	defer endLeadership()
	disconnected := p.nc.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	defer p.nc.RemoveStatusListener(disconnected)
	go func() {
		select {
		case <-disconnected:
			endLeadership()
		case <-ctx.Done():
		}
	}()
	conn, err := pgx.ConnectConfig(ctx, p.pool.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connect for leader lock: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var got bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, int64(leaderLockID)).Scan(&got); err != nil {
		return fmt.Errorf("leader lock: %w", err)
	}
	if !got {
		return nil // another replica leads; try again later
	}
	if _, err := conn.Exec(ctx, `LISTEN sluice_outbox`); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	p.setLeader(true)
	defer p.setLeader(false)
	p.log.Info("publisher is leader", "instance", p.cfg.InstanceID)

	lctx, cancel := context.WithCancel(ctx)
	wake := make(chan struct{}, 1)
	lost := make(chan error, 1)
	listenDone := make(chan struct{})
	// Stop the listener before the deferred conn.Close runs.
	defer func() { cancel(); <-listenDone }()
	go func() {
		defer close(listenDone)
		for {
			if _, err := conn.WaitForNotification(lctx); err != nil {
				lost <- err
				return
			}
			select {
			case wake <- struct{}{}:
			default:
			}
		}
	}()
	resync := make(chan struct{}, 1)
	rsub, err := p.nc.Subscribe(wire.ResyncSubject, func(m *nats.Msg) {
		p.log.Info("data plane asked for a fresh snapshot", "region", string(m.Data))
		select {
		case resync <- struct{}{}:
		default:
		}
	})
	if err != nil {
		return fmt.Errorf("subscribe to resync requests: %w", err)
	}
	defer func() { _ = rsub.Unsubscribe() }()
	if err := p.ensureInfra(ctx); err != nil {
		return err
	}
	p.mu.Lock()
	p.pointers = map[string]*configv1.SnapshotPointer{}
	p.mu.Unlock()

	var dirtySince, lastChange time.Time
	need, err := p.needsInitialCompile(ctx)
	if err != nil {
		return err
	}
	if need {
		dirtySince, lastChange = time.Now(), time.Now().Add(-p.cfg.Debounce)
	}
	lastCompile := time.Now()
	// With a compile pending, pointers are written after it: the recorded
	// versions may point at snapshots NATS no longer has.
	refreshPointers := !need
	for {
		changed, pointerRegions, err := p.publishAll(ctx)
		if err != nil {
			return err
		}
		if changed {
			if dirtySince.IsZero() {
				dirtySince = time.Now()
			}
			lastChange = time.Now()
		}
		periodic := time.Since(lastCompile) >= p.cfg.SnapshotInterval
		if need || periodic || !dirtySince.IsZero() && (time.Since(lastChange) >= p.cfg.Debounce || time.Since(dirtySince) >= p.cfg.MaxDelay) {
			need = false
			if err := p.compile(ctx); err != nil {
				p.compileErrors.Add(1)
				return err
			}
			lastCompile = time.Now()
			dirtySince = time.Time{}
			refreshPointers = true
		}
		if refreshPointers || len(pointerRegions) > 0 {
			needCompile, err := p.writePointers(ctx, refreshPointers, pointerRegions)
			if err != nil {
				return err
			}
			refreshPointers = false
			if needCompile && dirtySince.IsZero() {
				dirtySince, lastChange = time.Now(), time.Now().Add(-p.cfg.Debounce)
				continue
			}
		}
		wait := p.cfg.PollInterval
		if !dirtySince.IsZero() {
			wait = min(wait, max(time.Millisecond, p.cfg.Debounce-time.Since(lastChange)))
		}
		select {
		case <-ctx.Done():
			return nil
		case err := <-lost:
			return fmt.Errorf("leader connection: %w", err)
		case <-wake:
		case <-resync:
			if dirtySince.IsZero() {
				dirtySince = time.Now()
			}
			lastChange = time.Now().Add(-p.cfg.Debounce)
		case <-time.After(wait):
		}
	}
}

// ensureInfra creates the buckets and every region's stream.
func (p *Publisher) ensureInfra(ctx context.Context) error {
	if _, err := p.js.CreateOrUpdateObjectStore(ctx, jetstream.ObjectStoreConfig{
		Bucket: wire.SnapshotBucket, Storage: jetstream.FileStorage, Replicas: p.cfg.Replicas,
	}); err != nil {
		return fmt.Errorf("snapshot bucket: %w", err)
	}
	if _, err := p.js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket: wire.PointerBucket, History: 10, Storage: jetstream.FileStorage, Replicas: p.cfg.Replicas,
	}); err != nil {
		return fmt.Errorf("pointer bucket: %w", err)
	}
	if _, err := p.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        wire.UsageStream,
		Description: "usage events of every region, consumed into the spend ledger",
		Subjects:    []string{wire.UsageSubjectAll},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      UsageStreamMaxAge,
		Duplicates:  UsageDuplicateWindow,
		Replicas:    p.cfg.Replicas,
	}); err != nil {
		return fmt.Errorf("usage stream: %w", err)
	}
	if _, err := p.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        wire.AlertStream,
		Description: "budget alerts of every region, recorded into budget_alerts",
		Subjects:    []string{wire.AlertSubjectAll},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      AlertStreamMaxAge,
		Duplicates:  AlertDuplicateWindow,
		Replicas:    p.cfg.Replicas,
	}); err != nil {
		return fmt.Errorf("alert stream: %w", err)
	}
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return err
	}
	for _, r := range regions {
		if err := p.ensureStream(ctx, r.Name); err != nil {
			return err
		}
	}
	return nil
}

func (p *Publisher) ensureStream(ctx context.Context, region string) error {
	_, err := p.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:       wire.EventStream(region),
		Subjects:   []string{wire.EventSubject(region)},
		Storage:    jetstream.FileStorage,
		Retention:  jetstream.LimitsPolicy,
		MaxAge:     p.cfg.StreamMaxAge,
		Duplicates: DefaultDuplicateWindow,
		Replicas:   p.cfg.Replicas,
	})
	if err != nil {
		return fmt.Errorf("event stream of region %s: %w", region, err)
	}
	return nil
}

func (p *Publisher) needsInitialCompile(ctx context.Context) (bool, error) {
	next, err := p.store.NextConfigVersion(ctx)
	if err != nil {
		return false, err
	}
	if next == 1 {
		return true, nil
	}
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return false, err
	}
	need := false
	for _, r := range regions {
		if r.CurrentVersion == 0 {
			need = true
		}
		lost, err := p.realignStream(ctx, r)
		if err != nil {
			return false, err
		}
		if lost {
			need = true
		}
	}
	// NATS may have lost the buckets' contents (a new server, a wiped
	// store): every region needs a pointer to a snapshot that exists.
	kv, err := p.js.KeyValue(ctx, wire.PointerBucket)
	if err != nil {
		return false, fmt.Errorf("pointer bucket: %w", err)
	}
	obs, err := p.js.ObjectStore(ctx, wire.SnapshotBucket)
	if err != nil {
		return false, fmt.Errorf("snapshot bucket: %w", err)
	}
	for _, r := range regions {
		e, err := kv.Get(ctx, wire.PointerKey(r.Name))
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			need = true
			continue
		}
		if err != nil {
			return false, fmt.Errorf("read pointer of region %s: %w", r.Name, err)
		}
		ptr := &configv1.SnapshotPointer{}
		if proto.Unmarshal(e.Value(), ptr) != nil {
			need = true
			continue
		}
		if _, err := obs.GetInfo(ctx, ptr.GetObject()); errors.Is(err, jetstream.ErrObjectNotFound) {
			need = true
		} else if err != nil {
			return false, fmt.Errorf("check snapshot object %s: %w", ptr.GetObject(), err)
		}
	}
	if need {
		p.log.Warn("compiling a fresh snapshot at start: NATS lacks a region's pointer, snapshot or events")
	}
	return need, nil
}

// realignStream handles a region stream that is behind the database's
// position (NATS lost data, or a new NATS server): it moves the stream's
// next sequence to the database's position + 1 so appends continue, and
// reports true so a fresh snapshot covers whatever was lost.
func (p *Publisher) realignStream(ctx context.Context, r store.RegionState) (bool, error) {
	st, err := p.js.Stream(ctx, wire.EventStream(r.Name))
	if err != nil {
		return false, fmt.Errorf("event stream of region %s: %w", r.Name, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return false, fmt.Errorf("event stream of region %s: %w", r.Name, err)
	}
	if info.State.LastSeq >= uint64(r.RegionSeq) {
		return false, nil
	}
	p.log.Warn("region event stream is behind the database; realigning (NATS lost data?)",
		"region", r.Name, "stream_last_seq", info.State.LastSeq, "region_seq", r.RegionSeq)
	if err := st.Purge(ctx, jetstream.WithPurgeSequence(uint64(r.RegionSeq)+1)); err != nil {
		return false, fmt.Errorf("realign event stream of region %s: %w", r.Name, err)
	}
	return true, nil
}

// publishAll publishes every pending outbox row. It reports whether any
// configuration changed and which regions' pointers must be rewritten.
func (p *Publisher) publishAll(ctx context.Context) (bool, map[string]bool, error) {
	changed := false
	pointerRegions := map[string]bool{}
	for {
		n, err := p.store.PublishPending(ctx, batchSize, func(ctx context.Context, rows []store.OutboxRow, regions []store.RegionState) (map[string]int64, error) {
			seqs := map[string]int64{}
			for _, r := range regions {
				seqs[r.Name] = r.RegionSeq
			}
			for _, row := range rows {
				if row.Kind == store.EventRegionPointer {
					pointerRegions[row.ObjectID] = true
					if err := p.ensureStream(ctx, row.ObjectID); err != nil {
						return nil, err
					}
					continue
				}
				changed = true
				ev, err := p.buildEvent(ctx, row)
				if err != nil {
					return nil, fmt.Errorf("build event %d (%s): %w", row.Seq, row.Kind, err)
				}
				for _, r := range regions {
					if r.Policy != "auto" && !ev.Security {
						continue
					}
					next := seqs[r.Name] + 1
					data, err := proto.Marshal(&configv1.RegionEvent{Region: r.Name, RegionSeq: uint64(next), Event: ev})
					if err != nil {
						return nil, err
					}
					pctx, cancel := context.WithTimeout(ctx, publishTimeout)
					_, err = p.js.Publish(pctx, wire.EventSubject(r.Name), data,
						jetstream.WithMsgID(wire.EventMsgID(r.Name, uint64(next))),
						jetstream.WithExpectLastSequence(uint64(next-1)))
					cancel()
					if err != nil && !p.appendedBefore(ctx, r.Name, uint64(next), row.Seq) {
						return nil, fmt.Errorf("publish event %d to region %s: %w", row.Seq, r.Name, err)
					}
					seqs[r.Name] = next
					p.eventsPublished.Add(1)
				}
			}
			return seqs, nil
		})
		if err != nil {
			return changed, pointerRegions, err
		}
		if n < batchSize {
			return changed, pointerRegions, nil
		}
	}
}

// appendedBefore reports whether region's stream already holds the event
// of outbox row seq at regionSeq. A leader that died after appending it
// but before recording the region position in Postgres leaves it there,
// and the next leader's append of the same row fails: the server checks
// the expected last sequence before its dedupe window, so the retry is
// refused rather than acknowledged as a duplicate. The stored copy stands
// (events carry state, and later rows carry later state).
func (p *Publisher) appendedBefore(ctx context.Context, region string, regionSeq uint64, seq int64) bool {
	s, err := p.js.Stream(ctx, wire.EventStream(region))
	if err != nil {
		return false
	}
	m, err := s.GetMsg(ctx, regionSeq)
	if err != nil {
		return false
	}
	re := &configv1.RegionEvent{}
	if proto.Unmarshal(m.Data, re) != nil || re.GetRegionSeq() != regionSeq || re.GetEvent().GetSeq() != uint64(seq) {
		return false
	}
	p.log.Warn("event already appended by an earlier leader; keeping it", "region", region, "region_seq", regionSeq, "seq", seq)
	return true
}

// securityKinds reach every region at once.
func isSecurity(row store.OutboxRow) bool {
	switch {
	case strings.HasSuffix(row.Kind, ".blocked"), strings.HasSuffix(row.Kind, ".deleted"):
		return true
	case row.Kind == store.EventKeyRotated:
		var pl struct {
			GraceUntil string `json:"grace_until"`
		}
		_ = json.Unmarshal(row.Payload, &pl)
		return pl.GraceUntil == ""
	}
	return false
}

// buildEvent turns an outbox row into a state-carrying event, reading the
// object's current state (a later row carries any later state).
func (p *Publisher) buildEvent(ctx context.Context, row store.OutboxRow) (*configv1.Event, error) {
	ev := &configv1.Event{Seq: uint64(row.Seq), At: timestamppb.New(row.At), Kind: row.Kind, Security: isSecurity(row)}
	if strings.HasSuffix(row.Kind, ".blocked") || strings.HasSuffix(row.Kind, ".unblocked") {
		ev.Change = &configv1.Event_Block{Block: &configv1.BlockChange{
			ObjectType: row.ObjectType, Id: row.ObjectID, Blocked: strings.HasSuffix(row.Kind, ".blocked"),
		}}
		return ev, nil
	}
	gone := func(err error) bool { return errors.Is(err, store.ErrNotFound) }
	all := store.Tenant{}
	switch row.ObjectType {
	case "org":
		o, err := p.store.OrgGet(ctx, all, row.ObjectID)
		if gone(err) || row.Kind == store.EventOrgDeleted {
			ev.Change = &configv1.Event_OrgDeleted{OrgDeleted: row.ObjectID}
			return ev, nil
		} else if err != nil {
			return nil, err
		}
		m, err := orgMsg(o)
		ev.Change = &configv1.Event_Org{Org: m}
		return ev, err
	case "team":
		t, err := p.store.TeamGet(ctx, all, row.ObjectID)
		if gone(err) || row.Kind == store.EventTeamDeleted {
			ev.Change = &configv1.Event_TeamDeleted{TeamDeleted: row.ObjectID}
			return ev, nil
		} else if err != nil {
			return nil, err
		}
		m, err := teamMsg(t)
		ev.Change = &configv1.Event_Team{Team: m}
		return ev, err
	case "user":
		u, err := p.store.UserGet(ctx, all, row.ObjectID)
		if gone(err) || row.Kind == store.EventUserDeleted {
			ev.Change = &configv1.Event_UserDeleted{UserDeleted: row.ObjectID}
			return ev, nil
		} else if err != nil {
			return nil, err
		}
		m, err := userMsg(u)
		ev.Change = &configv1.Event_User{User: m}
		return ev, err
	case "customer":
		c, err := p.store.CustomerGet(ctx, all, row.ObjectID)
		if gone(err) || row.Kind == store.EventCustomerDeleted {
			ev.Change = &configv1.Event_CustomerDeleted{CustomerDeleted: row.ObjectID}
			return ev, nil
		} else if err != nil {
			return nil, err
		}
		m, err := customerMsg(c)
		ev.Change = &configv1.Event_Customer{Customer: m}
		return ev, err
	case "key":
		k, err := p.store.ConfigKeyGet(ctx, row.ObjectID)
		if gone(err) || row.Kind == store.EventKeyDeleted {
			ev.Change = &configv1.Event_KeyDeleted{KeyDeleted: row.ObjectID}
			return ev, nil
		} else if err != nil {
			return nil, err
		}
		m, err := keyMsg(k, time.Now())
		ev.Change = &configv1.Event_Key{Key: m}
		return ev, err
	case "team_member":
		var ref struct {
			TeamID string `json:"team_id"`
			UserID string `json:"user_id"`
		}
		if err := json.Unmarshal(row.Payload, &ref); err != nil || ref.TeamID == "" || ref.UserID == "" {
			if i := strings.IndexByte(row.ObjectID, '/'); i > 0 {
				ref.TeamID, ref.UserID = row.ObjectID[:i], row.ObjectID[i+1:]
			}
		}
		mb, err := p.store.ConfigMemberGet(ctx, ref.TeamID, ref.UserID)
		if gone(err) || row.Kind == store.EventMemberDeleted {
			ev.Change = &configv1.Event_MemberDeleted{MemberDeleted: &configv1.MemberRef{TeamId: ref.TeamID, UserId: ref.UserID}}
			return ev, nil
		} else if err != nil {
			return nil, err
		}
		m, err := memberMsg(mb)
		ev.Change = &configv1.Event_Member{Member: m}
		return ev, err
	case "model_group":
		g, err := p.store.ModelGroupGet(ctx, row.ObjectID)
		if gone(err) || row.Kind == store.EventModelGroupDeleted {
			ev.Change = &configv1.Event_ModelGroupDeleted{ModelGroupDeleted: row.ObjectID}
			return ev, nil
		} else if err != nil {
			return nil, err
		}
		ev.Change = &configv1.Event_ModelGroup{ModelGroup: modelGroupMsg(g)}
		return ev, nil
	case "deployment":
		d, err := p.store.DeploymentGet(ctx, row.ObjectID)
		if gone(err) || row.Kind == store.EventDeploymentDeleted {
			ev.Change = &configv1.Event_DeploymentDeleted{DeploymentDeleted: row.ObjectID}
			return ev, nil
		} else if err != nil {
			return nil, err
		}
		ev.Change = &configv1.Event_Deployment{Deployment: deploymentMsg(d)}
		return ev, nil
	}
	return nil, fmt.Errorf("unknown object type %q", row.ObjectType)
}

// compile builds, stores and records a new snapshot version.
func (p *Publisher) compile(ctx context.Context) error {
	start := time.Now()
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return err
	}
	seqs := map[string]int64{}
	for _, r := range regions {
		seqs[r.Name] = r.RegionSeq
	}
	st, err := p.store.ConfigState(ctx)
	if err != nil {
		return err
	}
	v, err := p.store.NextConfigVersion(ctx)
	if err != nil {
		return err
	}
	now := p.cfg.Now().UTC()
	snap, err := snapshotFrom(st, uint64(v), now)
	if err != nil {
		return err
	}
	// A snapshot without its seeds would let a data plane that lost its
	// Redis counters start budgets from zero: no seeds, no snapshot (the
	// last one stays).
	if snap.BudgetSeeds, err = p.budgetSeeds(ctx, snap, now); err != nil {
		return err
	}
	body, digest, err := wire.EncodeSnapshot(snap)
	if err != nil {
		return err
	}
	obs, err := p.js.ObjectStore(ctx, wire.SnapshotBucket)
	if err != nil {
		return fmt.Errorf("snapshot bucket: %w", err)
	}
	name := wire.SnapshotObject(uint64(v))
	if _, err := obs.PutBytes(ctx, name, body); err != nil {
		return fmt.Errorf("store snapshot %d: %w", v, err)
	}
	if _, err := p.store.RecordConfigVersion(ctx, store.VersionRecord{
		Version: v, EventsSeq: st.EventsSeq, Digest: digest, Size: int64(len(body)), Object: name, CreatedAt: now,
	}, seqs); err != nil {
		return err
	}
	p.compiles.Add(1)
	p.lastVersion.Store(v)
	p.lastCompileNanos.Store(int64(time.Since(start)))
	p.lastSnapshotBytes.Store(int64(len(body)))
	p.lastBudgetSeeds.Store(int64(len(snap.BudgetSeeds)))
	p.log.Info("compiled snapshot", "version", v, "events_seq", st.EventsSeq, "keys", len(snap.Keys), "deployments", len(snap.Deployments),
		"budget_seeds", len(snap.BudgetSeeds),
		"size_bytes", len(body), "duration_ms", time.Since(start).Milliseconds())
	return nil
}

// writePointers writes the KV entry of the given regions (all with all),
// skipping unchanged ones. It reports whether some region lacks a
// position for its version (a new compile fixes that).
func (p *Publisher) writePointers(ctx context.Context, all bool, some map[string]bool) (bool, error) {
	kv, err := p.js.KeyValue(ctx, wire.PointerBucket)
	if err != nil {
		return false, fmt.Errorf("pointer bucket: %w", err)
	}
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return false, err
	}
	needCompile := false
	for _, r := range regions {
		if !all && !some[r.Name] {
			continue
		}
		ptr, err := p.store.RegionPointer(ctx, r.Name)
		if errors.Is(err, store.ErrNoPosition) {
			needCompile = true
			continue
		}
		if err != nil {
			return false, err
		}
		msg := &configv1.SnapshotPointer{Version: uint64(ptr.Version), Digest: ptr.Digest, EventsSeq: uint64(ptr.EventsSeq),
			RegionSeq: uint64(ptr.RegionSeq), Object: ptr.Object, Rollback: ptr.Rollback}
		p.mu.Lock()
		same := proto.Equal(p.pointers[r.Name], msg)
		p.mu.Unlock()
		if same {
			continue
		}
		data, err := proto.Marshal(msg)
		if err != nil {
			return false, err
		}
		if _, err := kv.Put(ctx, wire.PointerKey(r.Name), data); err != nil {
			return false, fmt.Errorf("write pointer of region %s: %w", r.Name, err)
		}
		p.mu.Lock()
		p.pointers[r.Name] = msg
		p.mu.Unlock()
		p.log.Info("region pointer", "region", r.Name, "version", ptr.Version, "region_seq", ptr.RegionSeq, "rollback", ptr.Rollback)
	}
	return needCompile, nil
}

func (p *Publisher) tickLoop(ctx context.Context) {
	t := time.NewTicker(p.cfg.TickInterval)
	defer t.Stop()
	for {
		data, _ := proto.Marshal(&configv1.Tick{At: timestamppb.Now(), ControlInstance: p.cfg.InstanceID})
		if err := p.nc.Publish(wire.TickSubject, data); err != nil && ctx.Err() == nil {
			p.log.Debug("tick not sent", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (p *Publisher) heartbeatLoop(ctx context.Context) {
	if p.cfg.OnHeartbeat == nil {
		return
	}
	ch := make(chan *nats.Msg, 1024)
	sub, err := p.nc.ChanQueueSubscribe(wire.HeartbeatSubjectAll, "sluice-control", ch)
	if err != nil {
		p.log.Error("heartbeat subscription failed", "error", err)
		return
	}
	defer func() { _ = sub.Unsubscribe() }()
	for {
		select {
		case <-ctx.Done():
			return
		case m := <-ch:
			hb := &configv1.Heartbeat{}
			if err := proto.Unmarshal(m.Data, hb); err != nil {
				p.log.Warn("undecodable heartbeat", "subject", m.Subject)
				continue
			}
			p.heartbeats.Add(1)
			if err := p.cfg.OnHeartbeat(ctx, hb); err != nil && ctx.Err() == nil {
				p.log.Warn("heartbeat not recorded", "instance", hb.GetInstanceId(), "error", err)
			}
		}
	}
}
