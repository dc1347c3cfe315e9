package configsync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/sluicegw/sluice/internal/testsvc"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

const region = "default"

// bus is an embedded NATS with the buckets and the region stream a
// control plane creates, written by the test as a control plane would.
type bus struct {
	t   *testing.T
	nc  *nats.Conn
	js  jetstream.JetStream
	kv  jetstream.KeyValue
	obs jetstream.ObjectStore
}

func newBus(t *testing.T) *bus {
	t.Helper()
	srv := testsvc.StartNATS(t)
	nc, err := nats.Connect(srv.URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: wire.PointerBucket, History: 10})
	require.NoError(t, err)
	obs, err := js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: wire.SnapshotBucket})
	require.NoError(t, err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: wire.EventStream(region), Subjects: []string{wire.EventSubject(region)}})
	require.NoError(t, err)
	return &bus{t: t, nc: nc, js: js, kv: kv, obs: obs}
}

// snapshot stores snapshot version (holding events up to eventsSeq, with
// orgs) and returns its pointer at region position regionSeq.
func (b *bus) snapshot(version, eventsSeq, regionSeq uint64, orgs ...string) *configv1.SnapshotPointer {
	b.t.Helper()
	s := &configv1.Snapshot{SchemaVersion: wire.SchemaVersion, Version: version, EventsSeq: eventsSeq}
	for _, id := range orgs {
		s.Orgs = append(s.Orgs, &configv1.Org{Id: id})
	}
	body, digest, err := wire.EncodeSnapshot(s)
	require.NoError(b.t, err)
	_, err = b.obs.PutBytes(context.Background(), wire.SnapshotObject(version), body)
	require.NoError(b.t, err)
	return &configv1.SnapshotPointer{Version: version, Digest: digest, EventsSeq: eventsSeq, RegionSeq: regionSeq, Object: wire.SnapshotObject(version)}
}

func (b *bus) point(ptr *configv1.SnapshotPointer) {
	b.t.Helper()
	data, err := proto.Marshal(ptr)
	require.NoError(b.t, err)
	_, err = b.kv.Put(context.Background(), wire.PointerKey(region), data)
	require.NoError(b.t, err)
}

func (b *bus) event(re *configv1.RegionEvent) {
	b.t.Helper()
	data, err := proto.Marshal(re)
	require.NoError(b.t, err)
	_, err = b.js.Publish(context.Background(), wire.EventSubject(region), data)
	require.NoError(b.t, err)
}

// run starts a Syncer on the bus and stops it at cleanup.
func (b *bus) run(cfg Config) *Syncer {
	b.t.Helper()
	cfg.Region, cfg.InstanceID = region, "dp-test"
	s, err := New(cfg, b.nc)
	require.NoError(b.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	b.t.Cleanup(func() {
		cancel()
		require.NoError(b.t, <-done)
	})
	return s
}

// TestSnapshotsEventsAndRefusals follows one data plane through a region's
// life: the first snapshot, events in order with a duplicate delivery
// skipped, a pointer to a lower version refused (the running catalog
// kept) until the pointer names the running version again, a snapshot
// with a wrong digest refused, a gap in the stream answered with a resync
// request, and the newer snapshot that follows applied.
func TestSnapshotsEventsAndRefusals(t *testing.T) {
	t.Parallel()
	b := newBus(t)
	resync, err := b.nc.SubscribeSync(wire.ResyncSubject)
	require.NoError(t, err)
	var created []string
	createdCh := make(chan []string, 16)
	s := b.run(Config{HeartbeatInterval: 50 * time.Millisecond, OnCreate: func(orgs, _ []string) { createdCh <- orgs }})
	require.False(t, s.Ready())

	v2 := b.snapshot(2, 0, 0, "o1")
	b.point(v2)
	testsvc.Eventually(t, s.Ready, 10*time.Second, 5*time.Millisecond)
	require.EqualValues(t, 2, s.Catalog().Version)
	require.True(t, s.Catalog().HasOrg("o1"))

	b.event(orgEvent(1, 1, "o2"))
	b.event(orgEvent(1, 1, "o2")) // delivered twice (stream seq 2)
	b.event(orgEvent(2, 2, "o3")) // stream seq 3, region seq 2
	testsvc.Eventually(t, func() bool { return s.Catalog().HasOrg("o3") }, 10*time.Second, 5*time.Millisecond)
	require.True(t, s.Catalog().HasOrg("o2"))
	require.EqualValues(t, 2, s.Catalog().RegionSeq)
	st := s.Stats()
	require.Equal(t, [3]int64{1, 2, 1}, [3]int64{st.SnapshotsApplied, st.EventsApplied, st.EventsSkipped})
	for range 2 {
		created = append(created, <-createdCh...)
	}
	require.Equal(t, []string{"o2", "o3"}, created)

	// A lower version that is not a rollback is refused.
	v1 := b.snapshot(1, 0, 0, "old")
	b.point(v1)
	testsvc.Eventually(t, func() bool { return s.Rejecting() != nil }, 10*time.Second, 5*time.Millisecond)
	require.Empty(t, cmp.Diff(&configv1.Rejecting{Version: 1, RunningVersion: 2,
		Reason: "version 1 is lower than the running 2 and not a rollback"}, s.Rejecting(),
		protocmp.Transform(), protocmp.IgnoreFields(&configv1.Rejecting{}, "since")))
	require.EqualValues(t, 2, s.Catalog().Version, "the running catalog is kept")
	require.True(t, s.Catalog().HasOrg("o3"))
	b.point(v2)
	testsvc.Eventually(t, func() bool { return s.Rejecting() == nil }, 10*time.Second, 5*time.Millisecond)

	// A body that does not match its pointer's digest is refused.
	bad := b.snapshot(3, 2, 2, "o1", "o2", "o3")
	bad.Digest = wire.Digest([]byte("something else"))
	b.point(bad)
	testsvc.Eventually(t, func() bool { return s.Rejecting().GetVersion() == 3 }, 10*time.Second, 5*time.Millisecond)
	require.Contains(t, s.Rejecting().GetReason(), wire.ErrDigest.Error())
	rej := s.Rejected()
	require.Len(t, rej, 2)
	require.Equal(t, []uint64{1, 3}, []uint64{rej[0].GetVersion(), rej[1].GetVersion()})

	// A gap: region seq 4 after 2. The data plane asks for a snapshot.
	b.event(orgEvent(4, 4, "o5"))
	msg, err := resync.NextMsg(10 * time.Second)
	require.NoError(t, err)
	require.Equal(t, region, string(msg.Data))
	require.False(t, s.Catalog().HasOrg("o5"), "nothing after a gap is applied")
	testsvc.Eventually(t, func() bool { return s.Stats().Resyncs > 0 }, 10*time.Second, 5*time.Millisecond)

	// The snapshot compiled for it covers the lost event.
	b.point(b.snapshot(4, 4, 4, "o1", "o2", "o3", "o4", "o5"))
	testsvc.Eventually(t, func() bool { return s.Catalog().Version == 4 }, 10*time.Second, 5*time.Millisecond)
	require.True(t, s.Catalog().HasOrg("o5"))
	require.Nil(t, s.Rejecting(), "an applied snapshot ends the refusals")
	b.event(orgEvent(5, 5, "o6"))
	testsvc.Eventually(t, func() bool { return s.Catalog().HasOrg("o6") }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, fmt.Sprint([]string{"o4", "o5"}), fmt.Sprint(<-createdCh), "orgs learnt from the snapshot")
}

// TestHeartbeats: heartbeats carry the instance, its health (starting
// before the first snapshot, then ok), the applied positions and the
// refusal in progress, and the admission backlog per class.
func TestHeartbeats(t *testing.T) {
	t.Parallel()
	b := newBus(t)
	hbs, err := b.nc.SubscribeSync(wire.HeartbeatSubject(region, "dp-test"))
	require.NoError(t, err)
	backlog := []*configv1.AdmissionBacklog{{TrafficClass: "interactive", InFlight: 1}, {TrafficClass: "agent", InFlight: 6, Queued: 3, Shed: 2}}
	s := b.run(Config{HeartbeatInterval: 20 * time.Millisecond, InFlight: func() int64 { return 7 },
		Backlog: func() []*configv1.AdmissionBacklog { return backlog }})

	next := func() *configv1.Heartbeat {
		t.Helper()
		msg, err := hbs.NextMsg(10 * time.Second)
		require.NoError(t, err)
		hb := &configv1.Heartbeat{}
		require.NoError(t, proto.Unmarshal(msg.Data, hb))
		return hb
	}
	first := next()
	require.Equal(t, "starting", first.GetHealth())
	require.Equal(t, "dp-test", first.GetInstanceId())
	require.Equal(t, region, first.GetRegion())
	require.EqualValues(t, 7, first.GetInFlight())
	require.Empty(t, cmp.Diff(backlog, first.GetAdmissionBacklog(), protocmp.Transform()))

	b.point(b.snapshot(3, 9, 0, "o1"))
	testsvc.Eventually(t, s.Ready, 10*time.Second, 5*time.Millisecond)
	b.point(b.snapshot(2, 0, 0))
	testsvc.Eventually(t, func() bool { return s.Rejecting() != nil }, 10*time.Second, 5*time.Millisecond)
	var hb *configv1.Heartbeat
	testsvc.Eventually(t, func() bool { hb = next(); return hb.GetRejecting() != nil }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, "ok", hb.GetHealth(), "not past the bound yet")
	require.Equal(t, [3]uint64{3, 9, 0}, [3]uint64{hb.GetAppliedVersion(), hb.GetEventsSeq(), hb.GetRegionSeq()})
	require.EqualValues(t, 2, hb.GetRejecting().GetVersion())
	require.Len(t, hb.GetRejected(), 1)
}
