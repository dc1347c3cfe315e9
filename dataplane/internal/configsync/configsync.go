// Package configsync keeps a data plane's catalog current (SPEC §6): it
// watches its region's snapshot pointer in JetStream KV, loads and
// verifies snapshots from the object store, applies the region's events in
// order from the snapshot's stream position, detects gaps (and resyncs),
// tracks staleness and publishes heartbeats.
//
// One goroutine at a time changes the catalog (under writeMu); requests
// read it through an atomic pointer without locks.
package configsync

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// Defaults.
const (
	DefaultHeartbeatInterval = 2 * time.Second
	// DefaultMaxRejecting is how long a data plane may refuse its region's
	// current snapshot before it reports itself unready.
	DefaultMaxRejecting = 30 * time.Second
	catchUpTimeout      = 5 * time.Second
	// installAttempts bounds how often a snapshot is caught up to events
	// the consumer applied while it loaded before the consumer is held
	// back for the last catch-up.
	installAttempts = 3
	maxRejected     = 10
)

// Config configures a Syncer.
type Config struct {
	Region     string
	InstanceID string
	// MaxStaleness is how long without contact from the control plane
	// before Stale reports true.
	MaxStaleness time.Duration
	// HeartbeatInterval is the heartbeat period (DefaultHeartbeatInterval
	// if 0).
	HeartbeatInterval time.Duration
	// MaxRejecting bounds how long the Syncer may keep refusing the
	// snapshot its region's pointer names (keeping an older one) before
	// RejectingPastBound reports true (DefaultMaxRejecting if 0).
	MaxRejecting time.Duration
	// Open decrypts deployment credentials (nil: deployments with a
	// credential are unavailable).
	Open catalog.OpenFunc
	// InFlight reports requests in flight, for heartbeats (nil: 0).
	InFlight func() int64
	// Ejected, when set, lists the deployments out of rotation for the
	// heartbeat (the fleet view).
	Ejected func() []*configv1.EjectedDeployment
	// Backlog, when set, is the admission backlog per traffic class for
	// the heartbeat.
	Backlog func() []*configv1.AdmissionBacklog
	Logger  *slog.Logger
	// OnCreate, when set, is called with the org ids and deployment ids an
	// event or a snapshot replacing the running one creates (absent from
	// the catalog before it), and with those of the first snapshot created
	// within FirstSnapshotNewAge, before the catalog that holds them is
	// published, each list in id order. It must return quickly.
	OnCreate func(orgs, deployments []string)
	// BeforeFirst, when set, is called with the first catalog before it is
	// published (before the data plane is ready).
	BeforeFirst func(*catalog.Catalog)
}

// Stats are counters for metrics.
type Stats struct {
	SnapshotsApplied  int64
	SnapshotsRejected int64
	EventsApplied     int64
	EventsSkipped     int64 // already in the snapshot, or duplicates
	Resyncs           int64
}

// Syncer keeps the catalog current.
type Syncer struct {
	cfg Config
	nc  *nats.Conn
	js  jetstream.JetStream
	log *slog.Logger

	cat         atomic.Pointer[catalog.Catalog]
	lastContact atomic.Int64 // unix nanos
	started     time.Time

	writeMu sync.Mutex
	gen     uint64

	mu       sync.Mutex
	rejected []*configv1.RejectedSnapshot
	// rejecting is set from the first refusal of the region's current
	// pointer until a snapshot is applied or the pointer names the running
	// version again; boundLogged once past the bound was logged.
	rejecting   *configv1.Rejecting
	boundLogged bool

	snapshotsApplied, snapshotsRejected, eventsApplied, eventsSkipped, resyncs atomic.Int64
}

// New returns a Syncer over nc.
func New(cfg Config, nc *nats.Conn) (*Syncer, error) {
	if !wire.ValidRegion(cfg.Region) {
		return nil, fmt.Errorf("invalid region %q", cfg.Region)
	}
	if cfg.HeartbeatInterval == 0 {
		cfg.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if cfg.MaxRejecting == 0 {
		cfg.MaxRejecting = DefaultMaxRejecting
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	s := &Syncer{cfg: cfg, nc: nc, js: js, log: cfg.Logger, started: time.Now()}
	s.lastContact.Store(time.Now().UnixNano())
	return s, nil
}

// Catalog returns the current catalog, or nil before the first snapshot.
func (s *Syncer) Catalog() *catalog.Catalog { return s.cat.Load() }

// Ready reports whether a snapshot has been applied.
func (s *Syncer) Ready() bool { return s.cat.Load() != nil }

// Staleness is the time since the last contact with the control plane
// (a tick, a pointer update or an event).
func (s *Syncer) Staleness() time.Duration {
	return time.Since(time.Unix(0, s.lastContact.Load()))
}

// Stale reports whether Staleness exceeds MaxStaleness.
func (s *Syncer) Stale() bool { return s.cfg.MaxStaleness > 0 && s.Staleness() > s.cfg.MaxStaleness }

// Stats returns the counters.
func (s *Syncer) Stats() Stats {
	return Stats{SnapshotsApplied: s.snapshotsApplied.Load(), SnapshotsRejected: s.snapshotsRejected.Load(),
		EventsApplied: s.eventsApplied.Load(), EventsSkipped: s.eventsSkipped.Load(), Resyncs: s.resyncs.Load()}
}

// Rejected returns the most recent rejected snapshots.
func (s *Syncer) Rejected() []*configv1.RejectedSnapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*configv1.RejectedSnapshot(nil), s.rejected...)
}

func (s *Syncer) touch() { s.lastContact.Store(time.Now().UnixNano()) }

func (s *Syncer) reject(version uint64, reason string) {
	s.snapshotsRejected.Add(1)
	s.log.Error("snapshot rejected; keeping the last good one", "version", version, "reason", reason)
	var running uint64
	if c := s.cat.Load(); c != nil {
		running = c.Version
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rejected = append(s.rejected, &configv1.RejectedSnapshot{Version: version, Reason: reason, At: timestamppb.Now()})
	if len(s.rejected) > maxRejected {
		s.rejected = s.rejected[len(s.rejected)-maxRejected:]
	}
	since := timestamppb.Now()
	if s.rejecting != nil {
		since = s.rejecting.GetSince()
	}
	s.rejecting = &configv1.Rejecting{Version: version, RunningVersion: running, Reason: reason, Since: since}
}

// accepted ends a run of refusals: a snapshot was applied, or the pointer
// names the running version again.
func (s *Syncer) accepted() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rejecting != nil && s.boundLogged {
		s.log.Info("no longer rejecting the control plane's snapshots", "rejected_for", time.Since(s.rejecting.GetSince().AsTime()).Round(time.Millisecond))
	}
	s.rejecting, s.boundLogged = nil, false
}

// Rejecting returns the run of refusals in progress (nil when the
// region's pointer names the running snapshot): since when, the refused
// version, the running one and why; PastBound once it has lasted longer
// than MaxRejecting.
func (s *Syncer) Rejecting() *configv1.Rejecting {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rejecting == nil {
		return nil
	}
	r := proto.Clone(s.rejecting).(*configv1.Rejecting)
	r.PastBound = time.Since(r.GetSince().AsTime()) > s.cfg.MaxRejecting
	return r
}

// RejectingFor is how long the Syncer has been refusing its region's
// current snapshot (0 when it is not).
func (s *Syncer) RejectingFor() time.Duration {
	if r := s.Rejecting(); r != nil {
		return time.Since(r.GetSince().AsTime())
	}
	return 0
}

// RejectingPastBound reports whether the Syncer has been refusing its
// region's current snapshot for longer than MaxRejecting: it runs an
// older configuration than the control plane publishes, and says so
// (health "rejecting", /readyz failing).
func (s *Syncer) RejectingPastBound() bool {
	r := s.Rejecting()
	return r != nil && r.GetPastBound()
}

// MaxRejecting is the bound of RejectingPastBound.
func (s *Syncer) MaxRejecting() time.Duration { return s.cfg.MaxRejecting }

// RejectingSummary describes r in one line: "version N < running M" for
// the refusal of an older snapshot, else the refused version and why.
func RejectingSummary(r *configv1.Rejecting) string {
	if r.GetVersion() != 0 && r.GetVersion() < r.GetRunningVersion() {
		return fmt.Sprintf("version %d < running %d", r.GetVersion(), r.GetRunningVersion())
	}
	return fmt.Sprintf("version %d: %s", r.GetVersion(), r.GetReason())
}

// Run syncs until ctx is done.
func (s *Syncer) Run(ctx context.Context) error {
	sub, err := s.nc.Subscribe(wire.TickSubject, func(*nats.Msg) { s.touch() })
	if err != nil {
		return fmt.Errorf("subscribe to ticks: %w", err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); s.heartbeatLoop(ctx) }()
	// A reconnect cuts a backoff wait short: after a NATS outage the
	// catalog must catch up at once, not a backoff period later.
	reconnected := s.nc.StatusChanged(nats.CONNECTED)
	defer s.nc.RemoveStatusListener(reconnected)
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := s.syncOnce(ctx)
		if ctx.Err() != nil {
			break
		}
		s.resyncs.Add(1)
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			// A data plane started before any control plane ran on this
			// NATS: nothing is wrong yet (not ready, retrying).
			s.log.Info("waiting for the control plane to create the config buckets", "error", err)
		} else {
			s.log.Warn("config sync restarting", "error", err)
		}
		if errors.Is(err, errReconnected) {
			// Catch up at once: ticks already say the config is fresh.
			backoff = 100 * time.Millisecond
			continue
		}
		select {
		case <-ctx.Done():
		case <-reconnected:
			backoff = 100 * time.Millisecond
			continue
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 2*time.Second)
		if err == nil || errors.Is(err, errGap) {
			backoff = 100 * time.Millisecond
		}
	}
	wg.Wait()
	return nil
}

var (
	errGap         = errors.New("gap in the region's event stream")
	errReconnected = errors.New("reconnected to NATS")
)

// syncOnce watches the region pointer and follows the event stream until
// something needs a fresh start.
func (s *Syncer) syncOnce(ctx context.Context) error {
	// A reconnect starts over with a fresh watch and consumer. Left to
	// themselves, after a server restart (which loses their ephemeral
	// consumers) the pointer watch recovers only when its heartbeats go
	// missing (10 s) and the event consumer retries with a backoff from
	// 1 s: seconds in which a block issued during the outage is not
	// enforced although the tick already says the config is fresh.
	reconnected := s.nc.StatusChanged(nats.CONNECTED)
	defer s.nc.RemoveStatusListener(reconnected)
	kv, err := s.js.KeyValue(ctx, wire.PointerBucket)
	if err != nil {
		return fmt.Errorf("pointer bucket: %w", err)
	}
	w, err := kv.Watch(ctx, wire.PointerKey(s.cfg.Region))
	if err != nil {
		return fmt.Errorf("watch pointer: %w", err)
	}
	defer func() { _ = w.Stop() }()
	restart := make(chan error, 1)
	consumerStarted := false
	var stopConsumer context.CancelFunc = func() {}
	defer func() { stopConsumer() }()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-restart:
			return err
		case <-reconnected:
			return errReconnected
		case e, ok := <-w.Updates():
			if !ok {
				return errors.New("pointer watch closed")
			}
			if e == nil {
				continue // initial values delivered
			}
			s.touch()
			if e.Operation() != jetstream.KeyValuePut {
				continue
			}
			ptr := &configv1.SnapshotPointer{}
			if err := proto.Unmarshal(e.Value(), ptr); err != nil {
				s.reject(0, "pointer does not decode: "+err.Error())
				continue
			}
			loaded, err := s.load(ctx, ptr)
			if err != nil {
				return err
			}
			if !s.Ready() || (!loaded && consumerStarted) {
				continue
			}
			consumerStarted = true
			stopConsumer()
			cctx, cancel := context.WithCancel(ctx)
			stopConsumer = cancel
			s.writeMu.Lock()
			gen := s.gen
			start := s.cat.Load().RegionSeq + 1
			s.writeMu.Unlock()
			go func() {
				if err := s.consume(cctx, gen, start); err != nil && cctx.Err() == nil {
					select {
					case restart <- err:
					default:
					}
				}
			}()
		}
	}
}

// load fetches, verifies and applies the snapshot ptr names. It returns
// false (and records why) when the snapshot is not applied.
func (s *Syncer) load(ctx context.Context, ptr *configv1.SnapshotPointer) (bool, error) {
	cur := s.cat.Load()
	if cur != nil {
		if ptr.GetVersion() == cur.Version && !ptr.GetRollback() {
			s.accepted() // the control plane points at what runs here
			return false, nil
		}
		if ptr.GetVersion() < cur.Version && !ptr.GetRollback() {
			s.reject(ptr.GetVersion(), fmt.Sprintf("version %d is lower than the running %d and not a rollback", ptr.GetVersion(), cur.Version))
			return false, nil
		}
	}
	obs, err := s.js.ObjectStore(ctx, wire.SnapshotBucket)
	if err != nil {
		return false, fmt.Errorf("snapshot bucket: %w", err)
	}
	start := time.Now()
	body, err := obs.GetBytes(ctx, ptr.GetObject())
	if err != nil {
		if errors.Is(err, jetstream.ErrObjectNotFound) {
			s.reject(ptr.GetVersion(), "snapshot object "+ptr.GetObject()+" not found")
			return false, nil
		}
		return false, fmt.Errorf("fetch snapshot %d: %w", ptr.GetVersion(), err)
	}
	snap, err := wire.DecodeSnapshot(body, ptr)
	if err != nil {
		s.reject(ptr.GetVersion(), err.Error())
		return false, nil
	}
	next, err := catalog.FromSnapshot(snap, ptr.GetRegionSeq(), s.cfg.Open)
	if err != nil {
		s.reject(ptr.GetVersion(), "invalid snapshot: "+err.Error())
		return false, nil
	}
	if cur == nil && s.cfg.BeforeFirst != nil {
		s.cfg.BeforeFirst(next)
	}
	if next, err = s.install(ctx, ptr.GetRollback(), next, cur); err != nil {
		return false, err
	}
	s.snapshotsApplied.Add(1)
	s.accepted()
	s.log.Info("snapshot applied", "version", next.Version, "events_seq", next.EventsSeq, "region_seq", next.RegionSeq,
		"rollback", ptr.GetRollback(), "size_bytes", len(body), "duration_ms", time.Since(start).Milliseconds())
	return true, nil
}

// install swaps next in for the running catalog; seen is the running
// catalog load compared next with (nil before the first snapshot).
//
// Before the swap next is caught up to the stream position the running
// catalog has applied, so that a block or revocation applied from the
// stream is never lifted by an older snapshot, even for a moment. A newer
// snapshot that holds every event applied here (events_seq not below the
// running one's) needs none: the events after its position are skipped as
// held when the consumer reads them again. That is also what keeps a data
// plane following when the stream itself went back (NATS restored from a
// backup): the region's events continue after the snapshot's position,
// not after this data plane's.
//
// The event consumer keeps applying events to the running catalog while a
// snapshot is fetched, decoded and caught up: a snapshot compiled just
// before a revocation committed, whose pointer the leader wrote just
// before appending the revocation, is loaded while the consumer applies
// it. So the swap happens under writeMu and only if the running catalog
// is still seen; otherwise next is caught up to the catalog now running
// and checked again. Catching up does not hold writeMu (the consumer keeps
// applying new blocks meanwhile) except on the last of installAttempts,
// where the consumer waits so that the loop ends.
func (s *Syncer) install(ctx context.Context, rollback bool, next, seen *catalog.Catalog) (*catalog.Catalog, error) {
	locked := false
	defer func() {
		if locked {
			s.writeMu.Unlock()
		}
	}()
	for attempt := 1; ; attempt++ {
		if seen != nil && seen.RegionSeq > next.RegionSeq && (rollback || next.EventsSeq < seen.EventsSeq) {
			var err error
			if next, err = s.catchUp(ctx, next, seen.RegionSeq); err != nil {
				return nil, err
			}
		}
		if !locked {
			s.writeMu.Lock()
			locked = true
		}
		if cur := s.cat.Load(); cur != seen {
			s.log.Info("events applied while a snapshot loaded; catching it up again", "version", next.Version,
				"region_seq", next.RegionSeq, "running_region_seq", cur.RegionSeq)
			seen = cur
			if attempt < installAttempts {
				s.writeMu.Unlock()
				locked = false
			}
			continue
		}
		if seen == nil {
			// Orgs and deployments created shortly before this data plane's
			// first snapshot: their epochs are missing because they are new,
			// not because Redis lost their state.
			s.firstCreated(next)
		} else {
			// Orgs and deployments whose creation this data plane learns
			// from the snapshot rather than an event (after a gap, or the
			// first snapshot of a distribution epoch).
			s.snapshotCreated(seen, next)
		}
		s.gen++
		s.cat.Store(next)
		return next, nil
	}
}

// catchUp applies the region's events after c up to regionSeq.
func (s *Syncer) catchUp(ctx context.Context, c *catalog.Catalog, regionSeq uint64) (*catalog.Catalog, error) {
	ctx, cancel := context.WithTimeout(ctx, catchUpTimeout)
	defer cancel()
	cons, err := s.js.OrderedConsumer(ctx, wire.EventStream(s.cfg.Region), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{wire.EventSubject(s.cfg.Region)},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy, OptStartSeq: c.RegionSeq + 1,
	})
	if err != nil {
		return nil, fmt.Errorf("catch-up consumer: %w", err)
	}
	it, err := cons.Messages()
	if err != nil {
		return nil, fmt.Errorf("catch-up consumer: %w", err)
	}
	defer stopOnDone(ctx, it)()
	for c.RegionSeq < regionSeq {
		msg, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			return nil, fmt.Errorf("catch up to region_seq %d: %w", regionSeq, err)
		}
		re := &configv1.RegionEvent{}
		if err := proto.Unmarshal(msg.Data(), re); err != nil {
			return nil, fmt.Errorf("undecodable region event: %w", err)
		}
		if c, err = s.step(c, re); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// iteratorStopGrace is how long stopOnDone leaves a reader whose context
// is done to stop its iterator itself.
const iteratorStopGrace = 2 * time.Second

// stopOnDone returns the function that the goroutine reading it (with
// Next(jetstream.NextContext(ctx))) defers: it stops it. When ctx is done,
// that reader's Next returns at once and the reader stops it itself: nats.go's
// ordered consumer leaks the pull subscription it creates when Stop races
// the consumer reset inside Next (after a missed heartbeat, say), since
// the reset then makes a new one after Stop has stopped the old. Only a
// Next stuck in a reset (whose retries only Stop ends: NATS unreachable) is
// stopped from another goroutine, after iteratorStopGrace.
func stopOnDone(ctx context.Context, it jetstream.MessagesContext) (stop func()) {
	done := make(chan struct{})
	go func() {
		select {
		case <-done:
			return
		case <-ctx.Done():
		}
		t := time.NewTimer(iteratorStopGrace)
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
			it.Stop()
		}
	}()
	return func() {
		it.Stop()
		close(done)
	}
}

// step applies one region event to c (pure: c is not changed).
func (s *Syncer) step(c *catalog.Catalog, re *configv1.RegionEvent) (*catalog.Catalog, error) {
	switch {
	case re.GetRegionSeq() <= c.RegionSeq:
		s.eventsSkipped.Add(1)
		return c, nil // duplicate delivery
	case re.GetRegionSeq() > c.RegionSeq+1:
		return nil, fmt.Errorf("%w: expected region_seq %d, got %d", errGap, c.RegionSeq+1, re.GetRegionSeq())
	}
	if re.GetEvent().GetSeq() <= c.EventsSeq {
		s.eventsSkipped.Add(1)
		return c.WithRegionSeq(re.GetRegionSeq()), nil // the snapshot holds it already
	}
	n, err := c.Apply(re.GetEvent(), re.GetRegionSeq())
	if err != nil {
		return nil, fmt.Errorf("apply event %d: %w", re.GetEvent().GetSeq(), err)
	}
	s.eventsApplied.Add(1)
	return n, nil
}

// created reports the org or deployment ev creates to Config.OnCreate.
func (s *Syncer) created(prev *catalog.Catalog, ev *configv1.Event) {
	if s.cfg.OnCreate == nil {
		return
	}
	switch ch := ev.GetChange().(type) {
	case *configv1.Event_Org:
		if !prev.HasOrg(ch.Org.GetId()) {
			s.cfg.OnCreate([]string{ch.Org.GetId()}, nil)
		}
	case *configv1.Event_Deployment:
		if !prev.HasDeployment(ch.Deployment.GetId()) {
			s.cfg.OnCreate(nil, []string{ch.Deployment.GetId()})
		}
	}
}

// FirstSnapshotNewAge is how recently an org or deployment of a data
// plane's first snapshot must have been created (its created_at) for the
// data plane to report it to Config.OnCreate as new. An older one whose
// limits epoch is missing is more likely to have lost its state (it was
// used before) and waits out the quarantine once.
const FirstSnapshotNewAge = 15 * time.Minute

// firstCreated reports to Config.OnCreate the orgs and deployments of the
// first snapshot created within FirstSnapshotNewAge.
func (s *Syncer) firstCreated(next *catalog.Catalog) {
	if s.cfg.OnCreate == nil {
		return
	}
	orgs, deps := next.CreatedSince(time.Now().Add(-FirstSnapshotNewAge))
	if len(orgs)+len(deps) > 0 {
		s.cfg.OnCreate(orgs, deps)
	}
}

// snapshotCreated reports to Config.OnCreate the orgs and deployments of
// next that cur lacks, each in id order.
func (s *Syncer) snapshotCreated(cur, next *catalog.Catalog) {
	if s.cfg.OnCreate == nil {
		return
	}
	var orgs, deps []string
	for _, id := range next.OrgIDs() {
		if !cur.HasOrg(id) {
			orgs = append(orgs, id)
		}
	}
	for _, d := range next.AllDeployments() {
		if !cur.HasDeployment(d.GetId()) {
			deps = append(deps, d.GetId())
		}
	}
	// In id order, as CreatedSince reports them (the catalog's maps have
	// none).
	slices.Sort(orgs)
	slices.Sort(deps)
	if len(orgs)+len(deps) > 0 {
		s.cfg.OnCreate(orgs, deps)
	}
}

// consume applies the region's events from start on, for generation gen.
func (s *Syncer) consume(ctx context.Context, gen, start uint64) error {
	cons, err := s.js.OrderedConsumer(ctx, wire.EventStream(s.cfg.Region), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{wire.EventSubject(s.cfg.Region)},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy, OptStartSeq: start,
	})
	if err != nil {
		return fmt.Errorf("event consumer: %w", err)
	}
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("event consumer: %w", err)
	}
	defer stopOnDone(ctx, it)()
	for {
		msg, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("next event: %w", err)
		}
		s.touch()
		re := &configv1.RegionEvent{}
		if err := proto.Unmarshal(msg.Data(), re); err != nil {
			return fmt.Errorf("undecodable region event at stream seq %d: %w", streamSeq(msg), err)
		}
		applied, err := s.apply(gen, re)
		if err == nil && !applied {
			return nil // a newer snapshot took over
		}
		if err != nil {
			s.log.Warn("resync needed", "error", err)
			if errors.Is(err, errGap) {
				s.requestSnapshot()
			}
			return err
		}
	}
}

// apply applies re to the running catalog for the consumer of generation
// gen. It reports false, applying nothing, when a newer snapshot took over
// (the consumer stops).
func (s *Syncer) apply(gen uint64, re *configv1.RegionEvent) (bool, error) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	if gen != s.gen {
		return false, nil
	}
	prev := s.cat.Load()
	n, err := s.step(prev, re)
	if err != nil {
		return false, err
	}
	s.created(prev, re.GetEvent())
	s.cat.Store(n)
	return true, nil
}

// requestSnapshot asks the control plane for a fresh snapshot of the
// region: one compiled now covers whatever the stream lost.
func (s *Syncer) requestSnapshot() {
	_ = s.nc.Publish(wire.ResyncSubject, []byte(s.cfg.Region))
}

func streamSeq(m jetstream.Msg) uint64 {
	md, err := m.Metadata()
	if err != nil {
		return 0
	}
	return md.Sequence.Stream
}

func (s *Syncer) health() string {
	switch {
	case !s.Ready():
		return "starting"
	case s.Stale():
		return "stale"
	case s.RejectingPastBound():
		return "rejecting"
	}
	return "ok"
}

// logPastBound logs, once per run of refusals, that it has outlasted the
// bound.
func (s *Syncer) logPastBound(r *configv1.Rejecting) {
	s.mu.Lock()
	first := !s.boundLogged && s.rejecting != nil
	s.boundLogged = s.boundLogged || first
	s.mu.Unlock()
	if first {
		s.log.Error("rejecting the control plane's snapshots for longer than the bound; /readyz now fails. "+
			"The control plane publishes versions this data plane will not run (its database restored or replaced while NATS kept its data?)",
			"rejecting", RejectingSummary(r), "reason", r.GetReason(), "since", r.GetSince().AsTime(), "max_rejecting", s.cfg.MaxRejecting)
	}
}

func (s *Syncer) heartbeatLoop(ctx context.Context) {
	t := time.NewTicker(s.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		hb := &configv1.Heartbeat{InstanceId: s.cfg.InstanceID, Region: s.cfg.Region, Health: s.health(),
			At: timestamppb.Now(), StalenessSeconds: s.Staleness().Seconds(), Rejected: s.Rejected(), Rejecting: s.Rejecting()}
		if hb.Rejecting.GetPastBound() {
			s.logPastBound(hb.Rejecting)
		}
		if c := s.cat.Load(); c != nil {
			hb.AppliedVersion, hb.EventsSeq, hb.RegionSeq = c.Version, c.EventsSeq, c.RegionSeq
		}
		if s.cfg.InFlight != nil {
			hb.InFlight = s.cfg.InFlight()
		}
		if s.cfg.Ejected != nil {
			hb.Ejected = s.cfg.Ejected()
		}
		if s.cfg.Backlog != nil {
			hb.AdmissionBacklog = s.cfg.Backlog()
		}
		if data, err := proto.Marshal(hb); err == nil {
			_ = s.nc.Publish(wire.HeartbeatSubject(s.cfg.Region, s.cfg.InstanceID), data)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
