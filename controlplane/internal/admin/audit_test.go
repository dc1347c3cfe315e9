package admin

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// seedChain writes n audited mutations and returns the org they touched.
func seedChain(t *testing.T, b *bundle, n int) *adminv1.Org {
	t.Helper()
	org := b.mkOrg("chain")
	for i := 1; i < n; i++ {
		_, err := b.root().Org.UpdateOrg(context.Background(), connect.NewRequest(&adminv1.UpdateOrgRequest{
			Org:        &adminv1.Org{Id: org.Id, Metadata: map[string]string{"i": fmt.Sprint(i)}},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"metadata"}},
		}))
		require.NoError(t, err)
	}
	return org
}

func verifyChain(t *testing.T, b *bundle) *adminv1.VerifyAuditChainResponse {
	t.Helper()
	resp, err := b.root().Audit.VerifyAuditChain(context.Background(), connect.NewRequest(&adminv1.VerifyAuditChainRequest{}))
	require.NoError(t, err)
	return resp.Msg
}

// tamper runs sql as the superuser with triggers disabled.
func tamper(t *testing.T, b *bundle, sql string, args ...any) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, b.dbURL)
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, `SET session_replication_role = replica`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, sql, args...)
	require.NoError(t, err)
}

func TestAuditChainDetectsTampering(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		sql       string
		args      []any
		brokenSeq int64
	}{
		{"edited", `UPDATE audit_log SET after_json = '{"name":"evil"}' WHERE seq = 3`, nil, 3},
		{"edited actor", `UPDATE audit_log SET actor = 'someone-else' WHERE seq = 2`, nil, 2},
		{"deleted", `DELETE FROM audit_log WHERE seq = 3`, nil, 3},
		{"deleted last", `DELETE FROM audit_log WHERE seq = 5`, nil, 5},
		{"reordered", `UPDATE audit_log SET seq = -seq WHERE seq IN (2, 3)`, nil, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			seedChain(t, b, 5)
			require.True(t, verifyChain(t, b).Ok)
			tamper(t, b, tc.sql, tc.args...)
			if tc.name == "reordered" {
				tamper(t, b, `UPDATE audit_log SET seq = CASE seq WHEN -2 THEN 3 WHEN -3 THEN 2 END WHERE seq < 0`)
			}
			res := verifyChain(t, b)
			require.False(t, res.Ok, "tampering (%s) must be detected", tc.name)
			require.Equal(t, tc.brokenSeq, res.BrokenSeq, res.Problem)
			require.NotEmpty(t, res.Problem)
		})
	}
	t.Run("inserted", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		seedChain(t, b, 5)
		// A forger shifts records 3.. up by one and inserts a well-formed
		// record at 3 chained to record 2. Record 4 (the old 3) no longer
		// links to it.
		recs, err := b.store.AuditList(context.Background(), storeAuditAll(), 100)
		require.NoError(t, err)
		forged := audit.Record{At: recs[1].At, Actor: "bootstrap", TokenID: "bootstrap", Action: "updated", ObjectType: "org", ObjectID: recs[1].ObjectID}
		audit.Seal(&forged, recs[1].Seq, recs[1].Hash)
		tamper(t, b, `UPDATE audit_log SET seq = seq + 1000 WHERE seq >= 3`)
		tamper(t, b, `UPDATE audit_log SET seq = seq - 999 WHERE seq >= 1000`)
		tamper(t, b, `INSERT INTO audit_log (seq, at, actor, token_id, action, object_type, object_id, prev_hash, hash)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
			forged.Seq, forged.At, forged.Actor, forged.TokenID, forged.Action, forged.ObjectType, forged.ObjectID, forged.PrevHash, forged.Hash)
		res := verifyChain(t, b)
		require.False(t, res.Ok)
		require.Equal(t, int64(4), res.BrokenSeq, res.Problem)
	})
}

func TestAuditLogIsAppendOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	seedChain(t, b, 2)
	ctx := context.Background()
	for _, sql := range []string{
		`UPDATE audit_log SET actor = 'x'`,
		`DELETE FROM audit_log`,
		`TRUNCATE audit_log`,
	} {
		_, err := b.pool.Exec(ctx, sql)
		require.Error(t, err, sql)
		require.Contains(t, err.Error(), "append-only", sql)
	}
	require.True(t, verifyChain(t, b).Ok)
}

func TestAuditChainUnderConcurrentWriters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const writers = 50
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for i := 0; i < writers; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			_, err := b.root().Org.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{Name: fmt.Sprintf("w%02d", i)}))
			errs <- err
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	res := verifyChain(t, b)
	require.True(t, res.Ok, res.Problem)
	require.Equal(t, int64(writers), res.Checked)
	// The outbox is numbered in the same commit order, without gaps.
	var n, maxSeq int64
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*), max(seq) FROM outbox`).Scan(&n, &maxSeq))
	require.Equal(t, int64(writers), n)
	require.Equal(t, int64(writers), maxSeq)
}

func TestAuditRecordContents(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("contents")
	tok := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_EDITOR, org.Id, "")
	_, err := b.as(tok).Org.UpdateOrg(ctx, connect.NewRequest(&adminv1.UpdateOrgRequest{
		Org: &adminv1.Org{Id: org.Id, Name: "renamed"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"name"}},
	}))
	require.NoError(t, err)
	who, err := b.as(tok).Token.WhoAmI(ctx, connect.NewRequest(&adminv1.WhoAmIRequest{}))
	require.NoError(t, err)
	list, err := b.as(tok).Audit.ListAuditEvents(ctx, connect.NewRequest(&adminv1.ListAuditEventsRequest{ObjectType: "org", Action: "updated"}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Events, 1)
	ev := list.Msg.Events[0]
	require.Equal(t, who.Msg.Principal, ev.Actor)
	require.Equal(t, who.Msg.Principal, ev.TokenId)
	require.Equal(t, org.Id, ev.ObjectId)
	require.Equal(t, org.Id, ev.OrgId)
	require.NotEmpty(t, ev.RequestId)
	require.Contains(t, ev.BeforeJson, `"name":"contents"`)
	require.Contains(t, ev.AfterJson, `"name":"renamed"`)
	// An org token sees only its org's records.
	other := b.mkOrg("other")
	_ = other
	all, err := b.as(tok).Audit.ListAuditEvents(ctx, connect.NewRequest(&adminv1.ListAuditEventsRequest{}))
	require.NoError(t, err)
	for _, e := range all.Msg.Events {
		require.Equal(t, org.Id, e.OrgId)
	}
}

// verifyAs runs one VerifyAuditChain call with tok.
func verifyAs(t *testing.T, b *bundle, tok string, req *adminv1.VerifyAuditChainRequest) (*adminv1.VerifyAuditChainResponse, error) {
	t.Helper()
	resp, err := b.as(tok).Audit.VerifyAuditChain(context.Background(), connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// verifyAll walks every page with tok and returns the pages.
func verifyAll(t *testing.T, b *bundle, tok string, pageSize int32) []*adminv1.VerifyAuditChainResponse {
	t.Helper()
	var pages []*adminv1.VerifyAuditChainResponse
	req := &adminv1.VerifyAuditChainRequest{PageSize: pageSize}
	for {
		page, err := verifyAs(t, b, tok, req)
		require.NoError(t, err)
		pages = append(pages, page)
		if !page.Ok || page.NextPageToken == "" {
			return pages
		}
		require.Less(t, len(pages), 1000, "pages end")
		req.PageToken = page.NextPageToken
	}
}

func checkedSum(pages []*adminv1.VerifyAuditChainResponse) (n int64) {
	for _, p := range pages {
		n += p.Checked
	}
	return n
}

// TestVerifyAuditChainPages: a verification call checks a bounded page;
// following the page tokens checks the whole chain, breaks are found on
// whichever page holds them, and bad arguments name the field.
func TestVerifyAuditChainPages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	seedChain(t, b, 25)
	pages := verifyAll(t, b, b.bootstrap, 10)
	require.Len(t, pages, 3)
	for i, want := range []int64{10, 10, 5} {
		require.True(t, pages[i].Ok, pages[i].Problem)
		require.Equal(t, want, pages[i].Checked)
	}
	require.Empty(t, pages[2].NextPageToken)
	// Exactly at the head: no empty extra page.
	require.Len(t, verifyAll(t, b, b.bootstrap, 25), 1)
	require.Equal(t, int64(25), verifyChain(t, b).Checked, "the default page covers a small chain")

	for _, tc := range []struct {
		req  *adminv1.VerifyAuditChainRequest
		want string
	}{
		{&adminv1.VerifyAuditChainRequest{PageSize: -1}, "page_size: must not be negative"},
		{&adminv1.VerifyAuditChainRequest{PageSize: 50001}, "page_size: must be at most 50000"},
		{&adminv1.VerifyAuditChainRequest{PageToken: "bm9wZQ"}, "page_token: not a token from a previous page"},
		{&adminv1.VerifyAuditChainRequest{PageToken: "dDoxOjI"}, "page_token"}, // a tenant token ("t:1:2")
	} {
		_, err := verifyAs(t, b, b.bootstrap, tc.req)
		require.Equal(t, "invalid_argument", codeOf(err), "%v", tc.req)
		require.Contains(t, err.Error(), tc.want)
	}

	// An edit in the middle is found on its page; records removed at the
	// end on the last page (the chain head check).
	tamper(t, b, `UPDATE audit_log SET after_json = '{"x":1}' WHERE seq = 15`)
	pages = verifyAll(t, b, b.bootstrap, 10)
	require.Len(t, pages, 2)
	require.False(t, pages[1].Ok)
	require.Equal(t, int64(15), pages[1].BrokenSeq, pages[1].Problem)
	require.Equal(t, int64(14), checkedSum(pages))
	b2 := setup(t)
	seedChain(t, b2, 12)
	tamper(t, b2, `DELETE FROM audit_log WHERE seq > 10`)
	pages = verifyAll(t, b2, b2.bootstrap, 10)
	last := pages[len(pages)-1]
	require.False(t, last.Ok)
	require.Equal(t, int64(11), last.BrokenSeq, last.Problem)
}

// TestVerifyAuditChainTenantView: an org or team token verifies only its
// tenant's records, and its answer tells nothing of anyone else's: not
// the platform-wide count (its answer is the same however much happens
// elsewhere), not breaks in other tenants' records.
func TestVerifyAuditChainTenantView(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	a := b.mkFixture("a")
	bOrg := b.mkFixture("b")
	viewerA := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, a.team1.OrgID, "")
	teamA := b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_VIEWER, a.team1.OrgID, a.team1.TeamID)
	count := func(where string, args ...any) int64 {
		var n int64
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM audit_log WHERE `+where, args...).Scan(&n))
		return n
	}
	orgCount := count(`org_id = $1`, a.team1.OrgID)
	teamCount := count(`org_id = $1 AND team_id = $2`, a.team1.OrgID, a.team1.TeamID)
	require.Greater(t, b.auditCount(), orgCount)
	require.Greater(t, orgCount, teamCount)
	require.Greater(t, teamCount, int64(0))

	viewA, err := verifyAs(t, b, viewerA, &adminv1.VerifyAuditChainRequest{})
	require.NoError(t, err)
	require.True(t, viewA.Ok, viewA.Problem)
	require.Equal(t, orgCount, viewA.Checked, "an org viewer checks its org's records")
	viewTeam, err := verifyAs(t, b, teamA, &adminv1.VerifyAuditChainRequest{})
	require.NoError(t, err)
	require.Equal(t, teamCount, viewTeam.Checked, "a team token checks its team's records")
	pages := verifyAll(t, b, viewerA, 2)
	require.Equal(t, orgCount, checkedSum(pages), "paged, the same records")
	// The platform sees the whole chain.
	require.Equal(t, b.auditCount(), checkedSum(verifyAll(t, b, b.bootstrap, 0)))

	// Much activity elsewhere (another org, new orgs, platform objects):
	// org A's answers do not change at all.
	for i := 0; i < 5; i++ {
		b.mkOrg(fmt.Sprintf("noise-%d", i))
		code, out := b.callJSON(b.bootstrap, "/sluice.admin.v1.UserService/CreateUser", builders["CreateUser"](bOrg.team1))
		require.Equal(t, "ok", code, "%s", out)
	}
	again, err := verifyAs(t, b, viewerA, &adminv1.VerifyAuditChainRequest{})
	require.NoError(t, err)
	require.True(t, proto.Equal(viewA, again), "org A learns nothing from others' activity:\n%v\n%v", viewA, again)
	pagesAgain := verifyAll(t, b, viewerA, 2)
	require.Equal(t, len(pages), len(pagesAgain))
	for i := range pages {
		require.True(t, proto.Equal(pages[i], pagesAgain[i]), "page %d", i)
	}

	// An edited record of org B: the platform finds it, org A's view is
	// unchanged (B's content is never read for A).
	var bSeq int64
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT max(seq) FROM audit_log WHERE org_id = $1`, bOrg.team1.OrgID).Scan(&bSeq))
	tamper(t, b, `UPDATE audit_log SET after_json = '{"x":1}' WHERE seq = $1`, bSeq)
	res := verifyChain(t, b)
	require.False(t, res.Ok)
	require.Equal(t, bSeq, res.BrokenSeq)
	again, err = verifyAs(t, b, viewerA, &adminv1.VerifyAuditChainRequest{})
	require.NoError(t, err)
	require.True(t, proto.Equal(viewA, again), "%v", again)

	// An edited record of org A: org A's view finds it.
	var aSeq int64
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT min(seq) FROM audit_log WHERE org_id = $1 AND team_id = $2`, a.team1.OrgID, a.team1.TeamID).Scan(&aSeq))
	tamper(t, b, `UPDATE audit_log SET actor = 'someone-else' WHERE seq = $1`, aSeq)
	for _, tok := range []string{viewerA, teamA} {
		res, err := verifyAs(t, b, tok, &adminv1.VerifyAuditChainRequest{})
		require.NoError(t, err)
		require.False(t, res.Ok)
		require.Equal(t, aSeq, res.BrokenSeq, res.Problem)
		require.Contains(t, res.Problem, "record edited")
	}
	// A page token of the platform view means nothing to a tenant.
	_, err = verifyAs(t, b, viewerA, &adminv1.VerifyAuditChainRequest{PageToken: "cDoxOmFi"})
	require.Equal(t, "invalid_argument", codeOf(err))
}

// TestVerifyAuditChainConcurrencyIsBounded: a replica runs at most
// maxConcurrentVerifications verifications; more are ResourceExhausted,
// and a freed slot serves again.
func TestVerifyAuditChainConcurrencyIsBounded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	seedChain(t, b, 3)
	s := newServer(Options{Store: b.store, Peppers: b.peppers, BootstrapToken: b.bootstrap})
	srv := httptest.NewServer(s.handler())
	t.Cleanup(srv.Close)
	c := adminv1connect.NewAuditServiceClient(http.DefaultClient, srv.URL, connect.WithInterceptors(bearer(b.bootstrap)))
	for i := 0; i < maxConcurrentVerifications; i++ {
		s.verifySlots <- struct{}{} // verifications in progress
	}
	_, err := c.VerifyAuditChain(context.Background(), connect.NewRequest(&adminv1.VerifyAuditChainRequest{}))
	require.Equal(t, "resource_exhausted", codeOf(err))
	require.Contains(t, err.Error(), "2 audit verifications are already running")
	<-s.verifySlots
	resp, err := c.VerifyAuditChain(context.Background(), connect.NewRequest(&adminv1.VerifyAuditChainRequest{}))
	require.NoError(t, err)
	require.Equal(t, int64(3), resp.Msg.Checked)
}
