package system

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane"
	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// This file checks the ordering guarantees of config distribution (issue
// 3, "Must show"): concurrent admin mutations reach every data plane in
// order and exactly once, a gap in a region's stream makes a data plane
// resync, and two control-plane replicas never duplicate or reorder an
// event, even when the leader dies between appending and recording.

// testRegion is the region every data plane of these tests runs.
const testRegion = dataplane.DefaultRegion

// eventsOnly is a publisher configuration under which no snapshot is
// compiled after the first one unless a data plane (or a test) asks for
// one: whatever a data plane knows beyond the first snapshot, it learned
// from the event stream.
var eventsOnly = controlplane.PublishConfig{Debounce: time.Hour, MaxDelay: time.Hour, TickInterval: 200 * time.Millisecond}

// startDistWith is startDist with the first control plane publishing under
// pc. It returns once the first snapshot's pointer is written, so that no
// test change can postpone the initial compile by the debounce.
func startDistWith(t *testing.T, pc controlplane.PublishConfig) *dist {
	t.Helper()
	d := &dist{&harness.Dist{T: t, NATS: testsvc.StartNATS(t), DatabaseURL: testsvc.NewDatabase(t)}}
	// Every mutation commits under the chain_head lock, so a thousand of
	// them queue on the commit fsync; this test database (dropped at the
	// end, never crashed) does not need durable commits. Visibility and
	// ordering, which the tests check, are unchanged.
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		_, err := conn.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{conn.Config().Database}.Sanitize()+` SET synchronous_commit = off`)
		require.NoError(t, err)
	})
	d.Admin = d.startControlWith("cp-1", pc)
	d.waitPointer(t, 1)
	return d
}

// startControlWith is startControl with pc.
func (d *dist) startControlWith(instance string, pc controlplane.PublishConfig) string {
	d.T.Helper()
	return d.StartControlConfig(controlplane.Config{DatabaseURL: d.DatabaseURL, InstanceID: instance, Publish: pc})
}

// js connects to the test's NATS server.
func (d *dist) js(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(d.NATS.URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return nc, js
}

// pg runs fn on a fresh connection to the test database.
func (d *dist) pg(t testing.TB, fn func(ctx context.Context, conn *pgx.Conn)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, d.DatabaseURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	fn(ctx, conn)
}

// outboxHead is the last outbox sequence assigned.
func (d *dist) outboxHead(t testing.TB) uint64 {
	t.Helper()
	var head int64
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		require.NoError(t, conn.QueryRow(ctx, `SELECT outbox_seq FROM chain_head`).Scan(&head))
	})
	return uint64(head)
}

// unpublished counts outbox rows not yet published.
func (d *dist) unpublished(t testing.TB) int {
	t.Helper()
	var n int
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&n))
	})
	return n
}

// waitPublished waits until the outbox is drained.
func (d *dist) waitPublished(t testing.TB, within time.Duration) {
	t.Helper()
	var n int
	if !harness.Until(func() bool { n = d.unpublished(t); return n == 0 }, within, 20*time.Millisecond) {
		t.Fatalf("%d outbox rows still unpublished after %s", n, within)
	}
}

// pointer reads the region's KV pointer and its raw bytes (nil if absent
// or undecodable).
func (d *dist) pointer(t testing.TB, js jetstream.JetStream) (*configv1.SnapshotPointer, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, wire.PointerBucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, nil
	}
	require.NoError(t, err)
	e, err := kv.Get(ctx, wire.PointerKey(testRegion))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, nil
	}
	require.NoError(t, err)
	ptr := &configv1.SnapshotPointer{}
	if proto.Unmarshal(e.Value(), ptr) != nil {
		return nil, e.Value()
	}
	return ptr, e.Value()
}

// waitPointer waits for a pointer of at least version min.
func (d *dist) waitPointer(t testing.TB, minVersion uint64) *configv1.SnapshotPointer {
	t.Helper()
	_, js := d.js(t)
	var ptr *configv1.SnapshotPointer
	harness.Eventually(t, func() bool {
		ptr, _ = d.pointer(t, js)
		return ptr != nil && ptr.GetVersion() >= minVersion
	}, 15*time.Second, 10*time.Millisecond, "no snapshot pointer of version >= %d", minVersion)
	return ptr
}

// freshSnapshot asks the leader for a snapshot of Postgres as it is now
// (the resync request a data plane sends after a gap) and returns it as a
// catalog, verified like a data plane verifies it.
func (d *dist) freshSnapshot(t testing.TB) (*dataplane.Catalog, *configv1.SnapshotPointer) {
	t.Helper()
	nc, js := d.js(t)
	before, _ := d.pointer(t, js)
	var ptr *configv1.SnapshotPointer
	deadline := time.Now().Add(15 * time.Second)
	for {
		// Repeated: a request sent while leadership changes hands is lost.
		require.NoError(t, nc.Publish(wire.ResyncSubject, []byte(testRegion)))
		for range 50 {
			if ptr, _ = d.pointer(t, js); ptr != nil && ptr.GetVersion() > before.GetVersion() {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if ptr != nil && ptr.GetVersion() > before.GetVersion() {
			break
		}
		require.False(t, time.Now().After(deadline), "no fresh snapshot after a resync request")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	obs, err := js.ObjectStore(ctx, wire.SnapshotBucket)
	require.NoError(t, err)
	body, err := obs.GetBytes(ctx, ptr.GetObject())
	require.NoError(t, err)
	snap, err := wire.DecodeSnapshot(body, ptr)
	require.NoError(t, err)
	c, err := dataplane.CatalogFromSnapshot(snap, ptr.GetRegionSeq())
	require.NoError(t, err)
	return c, ptr
}

// waitCaughtUp waits until every data plane's catalog includes the last
// outbox row, and returns each one's catalog at that moment.
func (d *dist) waitCaughtUp(t testing.TB, within time.Duration, ps ...*proxy) []*dataplane.Catalog {
	t.Helper()
	head := d.outboxHead(t)
	out := make([]*dataplane.Catalog, len(ps))
	deadline := time.Now().Add(within)
	for i, p := range ps {
		for out[i] = p.DP.Catalog(); out[i].EventsSeq != head; out[i] = p.DP.Catalog() {
			if time.Now().After(deadline) {
				t.Fatalf("data plane %d stuck at events_seq %d (region_seq %d, %+v); outbox head %d",
					i, out[i].EventsSeq, out[i].RegionSeq, p.DP.SyncStats(), head)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return out
}

// requireEqualsFresh compares each catalog with a fresh snapshot.
func (d *dist) requireEqualsFresh(t testing.TB, cats []*dataplane.Catalog) {
	t.Helper()
	fresh, ptr := d.freshSnapshot(t)
	for i, c := range cats {
		require.NoError(t, c.Equal(fresh), "data plane %d differs from snapshot %d of Postgres", i, ptr.GetVersion())
		require.Equal(t, fresh.EventsSeq, c.EventsSeq, "data plane %d", i)
	}
}

// streamEvent is one message of a region stream.
type streamEvent struct {
	streamSeq uint64
	msgID     string
	re        *configv1.RegionEvent
}

// readStream reads the region's whole event stream.
func (d *dist) readStream(t testing.TB) []streamEvent {
	t.Helper()
	_, js := d.js(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, wire.EventStream(testRegion))
	require.NoError(t, err)
	info, err := s.Info(ctx)
	require.NoError(t, err)
	want := int(info.State.Msgs)
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy})
	require.NoError(t, err)
	var out []streamEvent
	for len(out) < want {
		batch, err := cons.Fetch(min(500, want-len(out)), jetstream.FetchMaxWait(5*time.Second))
		require.NoError(t, err)
		got := 0
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			require.NoError(t, err)
			re := &configv1.RegionEvent{}
			require.NoError(t, proto.Unmarshal(m.Data(), re), "stream seq %d", md.Sequence.Stream)
			out = append(out, streamEvent{streamSeq: md.Sequence.Stream, msgID: m.Headers().Get(jetstream.MsgIDHeader), re: re})
		}
		require.NoError(t, batch.Error())
		require.NotZero(t, got, "stream read stalled at %d of %d messages", len(out), want)
	}
	return out
}

// requireCleanStream asserts the region stream is gap-free and ordered,
// and that it carries every outbox row exactly once, in outbox order.
func (d *dist) requireCleanStream(t testing.TB) []streamEvent {
	t.Helper()
	evs := d.readStream(t)
	var last uint64
	for i, e := range evs {
		require.Equal(t, uint64(i+1), e.streamSeq, "stream has a hole or a duplicate")
		require.Equal(t, e.streamSeq, e.re.GetRegionSeq(), "region_seq differs from the stream sequence")
		require.Equal(t, wire.EventMsgID(testRegion, e.streamSeq), e.msgID, "dedupe id")
		require.Equal(t, testRegion, e.re.GetRegion())
		require.Greater(t, e.re.GetEvent().GetSeq(), last, "event seq not strictly increasing at stream seq %d", e.streamSeq)
		last = e.re.GetEvent().GetSeq()
	}
	var rows []uint64
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		r, err := conn.Query(ctx, `SELECT seq FROM outbox WHERE kind <> 'region.pointer' ORDER BY seq`)
		require.NoError(t, err)
		seqs, err := pgx.CollectRows(r, pgx.RowTo[int64])
		require.NoError(t, err)
		for _, s := range seqs {
			rows = append(rows, uint64(s))
		}
	})
	got := make([]uint64, len(evs))
	for i, e := range evs {
		got[i] = e.re.GetEvent().GetSeq()
	}
	require.Equal(t, rows, got, "the stream must carry every outbox row exactly once, in order")
	require.Zero(t, d.unpublished(t), "outbox rows left unpublished")
	return evs
}

// workload issues random admin mutations over a set of tenants. Mutations
// may race (a key deleted while another goroutine blocks it): NotFound
// answers are expected; anything else is an error.
type workload struct {
	tenants []tenant
	mu      sync.Mutex
	keys    []string // every key created (deleted ones included)
	ok      atomic.Int64
	refused atomic.Int64
}

func newWorkload(d *dist, tenants int) *workload {
	w := &workload{}
	for i := range tenants {
		ten := d.NewTenant(fmt.Sprintf("org-%02d", i))
		w.tenants = append(w.tenants, ten)
		w.keys = append(w.keys, ten.KeyID)
	}
	return w
}

func (w *workload) randomKey(r *rand.Rand) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.keys[r.IntN(len(w.keys))]
}

// one issues one random mutation through c.
func (w *workload) one(ctx context.Context, c adminClients, r *rand.Rand) error {
	ten := w.tenants[r.IntN(len(w.tenants))]
	limits := &adminv1.Limits{RpmLimit: proto.Int64(int64(1 + r.IntN(10_000)))}
	var err error
	switch op := r.IntN(100); {
	case op < 20:
		var resp *connect.Response[adminv1.CreateKeyResponse]
		resp, err = c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{
			OrgId: ten.OrgID, TeamId: ten.TeamID, UserId: ten.UserID, Alias: fmt.Sprintf("k-%d", r.Uint32()), Limits: limits,
		}))
		if err == nil {
			w.mu.Lock()
			w.keys = append(w.keys, resp.Msg.Key.Id)
			w.mu.Unlock()
		}
	case op < 35:
		_, err = c.Key.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
			Key: &adminv1.Key{Id: w.randomKey(r), Limits: limits}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits.rpm_limit"}},
		}))
	case op < 42:
		_, err = c.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{
			Team: &adminv1.Team{Id: ten.TeamID, Limits: limits}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}},
		}))
	case op < 47:
		_, err = c.User.UpdateUser(ctx, connect.NewRequest(&adminv1.UpdateUserRequest{
			User: &adminv1.User{Id: ten.UserID, Limits: limits}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}},
		}))
	case op < 57:
		_, err = c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: w.randomKey(r)}))
	case op < 67:
		_, err = c.Key.UnblockKey(ctx, connect.NewRequest(&adminv1.UnblockKeyRequest{Id: w.randomKey(r)}))
	case op < 70:
		_, err = c.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: ten.UserID}))
	case op < 73:
		_, err = c.User.UnblockUser(ctx, connect.NewRequest(&adminv1.UnblockUserRequest{Id: ten.UserID}))
	case op < 76:
		_, err = c.Team.BlockTeam(ctx, connect.NewRequest(&adminv1.BlockTeamRequest{Id: ten.TeamID}))
	case op < 79:
		_, err = c.Team.UnblockTeam(ctx, connect.NewRequest(&adminv1.UnblockTeamRequest{Id: ten.TeamID}))
	case op < 81:
		_, err = c.Org.BlockOrg(ctx, connect.NewRequest(&adminv1.BlockOrgRequest{Id: ten.OrgID}))
	case op < 83:
		_, err = c.Org.UnblockOrg(ctx, connect.NewRequest(&adminv1.UnblockOrgRequest{Id: ten.OrgID}))
	case op < 88:
		_, err = c.Key.RotateKey(ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: w.randomKey(r), GracePeriod: "1h"}))
	case op < 93:
		_, err = c.Key.RotateKey(ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: w.randomKey(r)}))
	default:
		_, err = c.Key.DeleteKey(ctx, connect.NewRequest(&adminv1.DeleteKeyRequest{Id: w.randomKey(r)}))
	}
	switch {
	case err == nil:
		w.ok.Add(1)
	case connect.CodeOf(err) == connect.CodeNotFound: // the key was deleted meanwhile
		w.refused.Add(1)
		return nil
	}
	return err
}

func TestOrderingUnderConcurrentMutations(t *testing.T) {
	t.Parallel()
	const mutations, workers = 1000, 32
	d := startDistWith(t, eventsOnly)
	_, js := d.js(t)
	first, _ := d.pointer(t, js)
	w := newWorkload(d, 8)
	ps := []*proxy{d.StartProxy(testRegion, time.Minute), d.StartProxy(testRegion, time.Minute), d.StartProxy(testRegion, time.Minute)}

	ctx := context.Background()
	c := d.Clients()
	var next atomic.Int64
	errs := make(chan error, workers)
	start := time.Now()
	var wg sync.WaitGroup
	for g := range workers {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 42))
			for next.Add(1) <= mutations {
				if err := w.one(ctx, c, r); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	issued := time.Since(start)

	cats := d.waitCaughtUp(t, 30*time.Second, ps...)
	caughtUp := time.Since(start)
	stats := make([]dataplane.SyncStats, len(ps))
	for i, p := range ps {
		stats[i] = p.DP.SyncStats()
	}
	t.Logf("%d mutations (%d applied, %d refused: key already deleted) by %d workers in %s; 3 data planes caught up after %s",
		mutations, w.ok.Load(), w.refused.Load(), workers, issued.Round(time.Millisecond), caughtUp.Round(time.Millisecond))
	require.Greater(t, w.ok.Load(), int64(mutations/2), "most mutations must succeed")

	// The stream itself: gap-free, ordered, every outbox row exactly once.
	evs := d.requireCleanStream(t)
	last := evs[len(evs)-1].streamSeq
	// What a data plane that loaded the first snapshot must have done with
	// each event after it: skip those the snapshot holds, apply the rest,
	// each once.
	var wantApplied, wantSkipped int64
	for _, e := range evs[first.GetRegionSeq():] {
		if e.re.GetEvent().GetSeq() <= first.GetEventsSeq() {
			wantSkipped++
		} else {
			wantApplied++
		}
	}
	for i, c := range cats {
		require.Equal(t, first.GetVersion(), c.Version, "data plane %d must have got there through events alone", i)
		require.Equal(t, last, c.RegionSeq, "data plane %d region_seq", i)
		s := stats[i]
		require.EqualValues(t, 1, s.SnapshotsApplied, "data plane %d", i)
		require.Zero(t, s.SnapshotsRejected, "data plane %d", i)
		require.Equal(t, wantApplied, s.EventsApplied, "data plane %d applied an event twice or missed one", i)
		require.Equal(t, wantSkipped, s.EventsSkipped, "data plane %d", i)
	}
	require.Greater(t, wantApplied, int64(mutations/2))

	d.requireEqualsFresh(t, cats)
}

func TestGapTriggersResync(t *testing.T) {
	t.Parallel()
	d := startDistWith(t, eventsOnly)
	nc, js := d.js(t)
	first, _ := d.pointer(t, js)
	ctx := context.Background()
	c := d.Clients()

	// Two tenants; the stream is then: a's org, team, user, member, key,
	// b's ... The message carrying a's key goes missing.
	a := d.NewTenant("gap-a")
	b := d.NewTenant("gap-b")
	d.waitPublished(t, 10*time.Second)
	var lost uint64
	for _, e := range d.readStream(t) {
		if k := e.re.GetEvent().GetKey(); k != nil && k.GetId() == a.KeyID {
			lost = e.streamSeq
		}
	}
	require.NotZero(t, lost, "a's key event is in the stream")
	require.Greater(t, lost, first.GetRegionSeq(), "the lost event is after the snapshot the data plane will load")
	s, err := js.Stream(ctx, wire.EventStream(testRegion))
	require.NoError(t, err)
	require.NoError(t, s.DeleteMsg(ctx, lost))

	asked := make(chan string, 64)
	sub, err := nc.Subscribe(wire.ResyncSubject, func(m *nats.Msg) {
		select {
		case asked <- string(m.Data):
		default:
		}
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	p := d.StartProxy(testRegion, time.Minute)
	select {
	case r := <-asked:
		require.Equal(t, testRegion, r, "the resync request names the region")
	case <-time.After(10 * time.Second):
		t.Fatal("the data plane never asked for a fresh snapshot")
	}
	// The fresh snapshot holds a's key: the data plane authenticates it.
	harness.WaitStatus(t, p, a.Token, http.StatusOK, 10*time.Second)
	harness.WaitStatus(t, p, b.Token, http.StatusOK, time.Second)
	st := p.DP.SyncStats()
	require.Positive(t, st.Resyncs, "the gap restarted the sync")
	require.GreaterOrEqual(t, st.SnapshotsApplied, int64(2), "a fresh snapshot was loaded")
	require.Greater(t, p.DP.Catalog().Version, first.GetVersion())

	// Events flow again after the resync.
	_, err = c.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: a.UserID}))
	require.NoError(t, err)
	harness.WaitStatus(t, p, a.Token, http.StatusForbidden, 2*time.Second)
	_, code := harness.Check(t, p, a.Token)
	require.Equal(t, "user_blocked", code)
	got, _ := harness.Check(t, p, "sk-sluice-not-a-real-token")
	require.Equal(t, http.StatusUnauthorized, got)

	cats := d.waitCaughtUp(t, 5*time.Second, p)
	d.requireEqualsFresh(t, cats)
}

func TestTwoControlPlaneReplicas(t *testing.T) {
	t.Parallel()
	const mutations, workers, killAt = 300, 16, 100
	d := startDist(t)
	d.waitPointer(t, 1) // cp-1, alone so far, leads
	urls := []string{d.Admin, d.StartControl("cp-2")}
	w := newWorkload(d, 6)
	ps := []*proxy{d.StartProxy(testRegion, time.Minute), d.StartProxy(testRegion, time.Minute)}

	ctx := context.Background()
	cs := []adminClients{harness.ClientsAt(urls[0]), harness.ClientsAt(urls[1])}
	var next, done atomic.Int64
	var killed atomic.Bool
	var kill sync.Once
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for g := range workers {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 7))
			for next.Add(1) <= mutations {
				if done.Load() >= killAt {
					// Kill the leader mid-way: cancel cp-1's context.
					kill.Do(func() { d.Controls[0](); killed.Store(true) })
				}
				c := cs[g%2]
				if killed.Load() {
					c = cs[1]
				}
				err := w.one(ctx, c, r)
				if err != nil && c == cs[0] && killed.Load() {
					err = w.one(ctx, cs[1], r) // cp-1 went away: the other replica takes it
				}
				if err != nil {
					errs <- err
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.True(t, killed.Load())
	t.Logf("%d mutations (%d applied, %d refused: key already deleted) across two replicas, leader killed after %d", mutations, w.ok.Load(), w.refused.Load(), killAt)

	// cp-2 takes over and drains the outbox; the stream carries each row
	// once, in order.
	d.waitPublished(t, 30*time.Second)
	d.requireCleanStream(t)
	cats := d.waitCaughtUp(t, 30*time.Second, ps...)
	d.requireEqualsFresh(t, cats)
}

// TestLeaderDiesBetweenAppendAndRecord replays the window a killed leader
// leaves behind: it appended the next outbox row's event to the stream but
// died before recording the new region position in Postgres. The next
// leader must recognise the append as its own row (not fail on the
// stream's expected-last-sequence check forever, nor append it twice).
func TestLeaderDiesBetweenAppendAndRecord(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ten := d.NewTenant("crash")
	p := d.StartProxy(testRegion, time.Minute)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 5*time.Second)
	d.waitPublished(t, 10*time.Second)

	// What the leader appends for the next row, a block of ten's key.
	_, js := d.js(t)
	ctx := context.Background()
	evs := d.readStream(t)
	nextSeq := uint64(len(evs)) + 1
	ev := &configv1.Event{Seq: d.outboxHead(t) + 1, At: timestamppb.Now(), Kind: "key.blocked", Security: true,
		Change: &configv1.Event_Block{Block: &configv1.BlockChange{ObjectType: "key", Id: ten.KeyID, Blocked: true}}}
	data, err := proto.Marshal(&configv1.RegionEvent{Region: testRegion, RegionSeq: nextSeq, Event: ev})
	require.NoError(t, err)
	_, err = js.Publish(ctx, wire.EventSubject(testRegion), data, jetstream.WithMsgID(wire.EventMsgID(testRegion, nextSeq)),
		jetstream.WithExpectLastSequence(nextSeq-1))
	require.NoError(t, err)

	// The row itself commits now.
	_, err = d.Clients().Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: ten.KeyID}))
	require.NoError(t, err)
	harness.WaitStatus(t, p, ten.Token, http.StatusForbidden, 2*time.Second)

	// Later rows go on normally.
	_, err = d.Clients().User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: ten.UserID}))
	require.NoError(t, err)
	d.waitPublished(t, 5*time.Second)
	d.requireCleanStream(t)
	cats := d.waitCaughtUp(t, 5*time.Second, p)
	d.requireEqualsFresh(t, cats)
}
