package admin

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
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
