package configsync

import (
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// newBareSyncer is a Syncer without NATS, for the parts of it that are
// pure state: refusals, staleness, health and event steps. Call it inside
// a synctest bubble when the test moves the clock.
func newBareSyncer(cfg Config) *Syncer {
	if cfg.MaxRejecting == 0 {
		cfg.MaxRejecting = DefaultMaxRejecting
	}
	s := &Syncer{cfg: cfg, log: slog.New(slog.DiscardHandler), started: time.Now()}
	s.lastContact.Store(time.Now().UnixNano())
	return s
}

// testCatalog builds a catalog of snapshot version with orgs, holding the
// events up to eventsSeq, at region position regionSeq.
func testCatalog(t *testing.T, version, eventsSeq, regionSeq uint64, orgs ...string) *catalog.Catalog {
	t.Helper()
	s := &configv1.Snapshot{SchemaVersion: wire.SchemaVersion, Version: version, EventsSeq: eventsSeq}
	for _, id := range orgs {
		s.Orgs = append(s.Orgs, &configv1.Org{Id: id})
	}
	c, err := catalog.FromSnapshot(s, regionSeq, nil)
	require.NoError(t, err)
	return c
}

func orgEvent(regionSeq, seq uint64, org string) *configv1.RegionEvent {
	return &configv1.RegionEvent{Region: "default", RegionSeq: regionSeq,
		Event: &configv1.Event{Seq: seq, Kind: "org", Change: &configv1.Event_Org{Org: &configv1.Org{Id: org}}}}
}

// TestRejectingBound: a run of refusals keeps the time of its first
// refusal, turns PastBound (health "rejecting") only once it has lasted
// longer than MaxRejecting, and ends when a snapshot is accepted.
func TestRejectingBound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newBareSyncer(Config{Region: "default", MaxRejecting: 30 * time.Second})
		s.cat.Store(testCatalog(t, 5, 0, 0))
		require.Nil(t, s.Rejecting())
		require.Zero(t, s.RejectingFor())
		require.Equal(t, "ok", s.health())

		start := time.Now()
		s.reject(3, "version 3 is lower than the running 5 and not a rollback")
		r := s.Rejecting()
		require.Empty(t, cmp.Diff(&configv1.Rejecting{Version: 3, RunningVersion: 5,
			Reason: "version 3 is lower than the running 5 and not a rollback"}, r,
			protocmp.Transform(), protocmp.IgnoreFields(&configv1.Rejecting{}, "since")))
		require.True(t, r.GetSince().AsTime().Equal(start))
		require.Equal(t, "version 3 < running 5", RejectingSummary(r))

		time.Sleep(20 * time.Second)
		s.reject(7, "snapshot object snapshot-7 not found") // the same run: since stays
		time.Sleep(10 * time.Second)
		require.Equal(t, 30*time.Second, s.RejectingFor())
		require.False(t, s.RejectingPastBound(), "exactly at the bound is not past it")
		require.Equal(t, "ok", s.health())

		time.Sleep(time.Millisecond)
		r = s.Rejecting()
		require.True(t, r.GetPastBound())
		require.True(t, r.GetSince().AsTime().Equal(start), "a later refusal keeps the run's start")
		require.EqualValues(t, 7, r.GetVersion(), "the latest refusal is reported")
		require.Equal(t, "version 7: snapshot object snapshot-7 not found", RejectingSummary(r))
		require.Equal(t, "rejecting", s.health())
		s.logPastBound(r)
		require.True(t, s.boundLogged)

		s.accepted()
		require.Nil(t, s.Rejecting())
		require.Zero(t, s.RejectingFor())
		require.False(t, s.boundLogged)
		require.Equal(t, "ok", s.health())
		require.EqualValues(t, 2, s.Stats().SnapshotsRejected)

		// A new run starts from its own first refusal.
		time.Sleep(time.Minute)
		s.reject(6, "invalid snapshot")
		require.Zero(t, s.RejectingFor())
		require.False(t, s.RejectingPastBound())
	})
}

// TestRejectedKeepsTheLastTen: the list of refused snapshots a heartbeat
// carries is bounded, newest last, and callers get a copy.
func TestRejectedKeepsTheLastTen(t *testing.T) {
	s := newBareSyncer(Config{Region: "default"})
	for v := uint64(1); v <= 15; v++ {
		s.reject(v, "bad")
	}
	got := s.Rejected()
	require.Len(t, got, maxRejected)
	var versions []uint64
	for _, r := range got {
		versions = append(versions, r.GetVersion())
	}
	require.Equal(t, []uint64{6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, versions)
	got[0] = nil
	require.NotNil(t, s.Rejected()[0], "Rejected returns a copy")
	require.EqualValues(t, 0, s.Rejecting().GetRunningVersion(), "nothing runs yet")
}

// TestStalenessBound: Stale holds once the time since the last contact
// exceeds MaxStaleness (never with MaxStaleness 0); any contact resets it;
// health reports starting before the first catalog, then stale over
// rejecting.
func TestStalenessBound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newBareSyncer(Config{Region: "default", MaxStaleness: 10 * time.Second, MaxRejecting: time.Second})
		require.Equal(t, "starting", s.health())
		s.cat.Store(testCatalog(t, 1, 0, 0))

		time.Sleep(10 * time.Second)
		require.Equal(t, 10*time.Second, s.Staleness())
		require.False(t, s.Stale(), "exactly at the bound is not stale")
		time.Sleep(time.Millisecond)
		require.True(t, s.Stale())
		require.Equal(t, "stale", s.health())

		s.reject(2, "bad")
		time.Sleep(2 * time.Second)
		require.True(t, s.RejectingPastBound())
		require.Equal(t, "stale", s.health(), "stale is reported over rejecting")

		s.touch()
		require.Zero(t, s.Staleness())
		require.False(t, s.Stale())
		require.Equal(t, "rejecting", s.health())

		off := newBareSyncer(Config{Region: "default"})
		time.Sleep(time.Hour)
		require.False(t, off.Stale(), "MaxStaleness 0 never turns stale")
	})
}

// TestStep: events apply in region order; a duplicate delivery or an
// event the snapshot already holds is skipped (the latter still advances
// the region position); a gap is an error; the input catalog is never
// changed.
func TestStep(t *testing.T) {
	s := newBareSyncer(Config{Region: "default"})
	c0 := testCatalog(t, 3, 10, 5, "o1")

	c1, err := s.step(c0, orgEvent(6, 11, "o2"))
	require.NoError(t, err)
	require.True(t, c1.HasOrg("o2"))
	require.False(t, c0.HasOrg("o2"), "step does not change its input")
	require.Equal(t, [2]uint64{11, 6}, [2]uint64{c1.EventsSeq, c1.RegionSeq})

	for _, dup := range []*configv1.RegionEvent{orgEvent(6, 11, "o2"), orgEvent(2, 7, "ox")} {
		got, err := s.step(c1, dup)
		require.NoError(t, err)
		require.Same(t, c1, got, "region_seq %d is a duplicate", dup.GetRegionSeq())
	}

	held, err := s.step(c1, orgEvent(7, 9, "held"))
	require.NoError(t, err)
	require.False(t, held.HasOrg("held"), "event 9 is held by the snapshot already")
	require.EqualValues(t, 7, held.RegionSeq)
	require.EqualValues(t, 11, held.EventsSeq)

	_, err = s.step(held, orgEvent(9, 12, "o3"))
	require.True(t, errors.Is(err, errGap), "%v", err)
	require.Contains(t, err.Error(), "expected region_seq 8, got 9")

	_, err = s.step(held, &configv1.RegionEvent{RegionSeq: 8, Event: &configv1.Event{Seq: 12}})
	require.ErrorIs(t, err, catalog.ErrUnknownChange)

	require.Equal(t, Stats{EventsApplied: 1, EventsSkipped: 3}, s.Stats())
}

// TestOnCreate: OnCreate hears of the orgs and deployments an event or a
// replacing snapshot creates, and of nothing already present.
func TestOnCreate(t *testing.T) {
	var orgs, deps []string
	s := newBareSyncer(Config{Region: "default", OnCreate: func(o, d []string) {
		orgs, deps = append(orgs, o...), append(deps, d...)
	}})
	cur := testCatalog(t, 1, 0, 0, "o1")
	s.created(cur, orgEvent(1, 1, "o1").GetEvent())
	require.Empty(t, orgs, "o1 exists")
	s.created(cur, orgEvent(1, 1, "o2").GetEvent())
	require.Equal(t, []string{"o2"}, orgs)
	s.created(cur, &configv1.Event{Change: &configv1.Event_Deployment{Deployment: &configv1.Deployment{Id: "d1"}}})
	require.Equal(t, []string{"d1"}, deps)

	orgs, deps = nil, nil
	s.snapshotCreated(cur, testCatalog(t, 2, 0, 0, "o1", "o3", "o4"))
	slices.Sort(orgs)
	require.Equal(t, []string{"o3", "o4"}, orgs)
	require.Empty(t, deps)
	orgs = nil
	s.snapshotCreated(cur, testCatalog(t, 2, 0, 0, "o1"))
	require.Nil(t, orgs, "no call when nothing is new")
}

func TestRejectingSummary(t *testing.T) {
	require.Equal(t, "version 2 < running 7", RejectingSummary(&configv1.Rejecting{Version: 2, RunningVersion: 7, Reason: "lower"}))
	got := RejectingSummary(&configv1.Rejecting{Version: 9, RunningVersion: 7, Reason: "digest mismatch"})
	require.True(t, strings.HasPrefix(got, "version 9: "), got)
	require.Equal(t, "version 0: pointer does not decode", RejectingSummary(&configv1.Rejecting{Reason: "pointer does not decode"}))
}
