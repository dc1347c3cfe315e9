package admin

import (
	"context"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

func mkCustomer(t *testing.T, c clients, orgID, externalID string) *adminv1.Customer {
	t.Helper()
	resp, err := c.Customer.CreateCustomer(context.Background(), connect.NewRequest(&adminv1.CreateCustomerRequest{OrgId: orgID, ExternalId: externalID}))
	require.NoError(t, err)
	return resp.Msg.Customer
}

func TestCustomerLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.root()
	org := b.mkOrg("acme")

	var cu *adminv1.Customer
	ucOneAudit(t, b, func() error {
		resp, err := c.Customer.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{
			OrgId: org.Id, ExternalId: "Cust-42", DisplayName: "Customer 42",
			Limits:   &adminv1.Limits{MaxBudget: proto.Float64(10), BudgetDuration: "1mo", TpmLimit: proto.Int64(10000)},
			Metadata: map[string]string{"plan": "pro"},
		}))
		if err == nil {
			cu = resp.Msg.Customer
		}
		return err
	})
	require.True(t, ids.Valid(ids.Customer, cu.Id), cu.Id)
	require.Equal(t, org.Id, cu.OrgId)
	require.Equal(t, "Cust-42", cu.ExternalId, "external ids keep their case")
	require.Equal(t, "Customer 42", cu.DisplayName)
	require.Equal(t, int64(10000), cu.Limits.GetTpmLimit())
	require.Equal(t, map[string]string{"plan": "pro"}, cu.Metadata)

	got, err := c.Customer.GetCustomer(ctx, connect.NewRequest(&adminv1.GetCustomerRequest{Id: cu.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(cu, got.Msg.Customer), "get returns what create returned")

	mkCustomer(t, c, org.Id, "other-1")
	list, err := c.Customer.ListCustomers(ctx, connect.NewRequest(&adminv1.ListCustomersRequest{OrgId: org.Id, ExternalIdPrefix: "Cust-"}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Customers, 1)
	require.Equal(t, cu.Id, list.Msg.Customers[0].Id)

	b.clock.Advance(1000000000)
	var upd *adminv1.Customer
	ucOneAudit(t, b, func() error {
		resp, err := c.Customer.UpdateCustomer(ctx, connect.NewRequest(&adminv1.UpdateCustomerRequest{
			Customer: &adminv1.Customer{Id: cu.Id, DisplayName: "C42", ExternalId: "ignored",
				Limits: &adminv1.Limits{RpmLimit: proto.Int64(30)}},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"display_name", "limits.rpm_limit"}},
		}))
		if err == nil {
			upd = resp.Msg.Customer
		}
		return err
	})
	require.Equal(t, "C42", upd.DisplayName)
	require.Equal(t, "Cust-42", upd.ExternalId)
	require.Equal(t, int64(30), upd.Limits.GetRpmLimit())
	require.Equal(t, int64(10000), upd.Limits.GetTpmLimit(), "limit fields outside the mask are kept")
	require.Equal(t, map[string]string{"plan": "pro"}, upd.Metadata, "fields outside the mask are kept")
	require.Equal(t, b.clock.Now(), upd.UpdateTime.AsTime())
	got, err = c.Customer.GetCustomer(ctx, connect.NewRequest(&adminv1.GetCustomerRequest{Id: cu.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(upd, got.Msg.Customer), "the update is stored")

	ucOneAudit(t, b, func() error {
		_, err := c.Customer.UpdateCustomer(ctx, connect.NewRequest(&adminv1.UpdateCustomerRequest{
			Customer:   &adminv1.Customer{Id: cu.Id, Metadata: map[string]string{"plan": "free"}},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"metadata"}},
		}))
		return err
	})

	ucOneAudit(t, b, func() error {
		resp, err := c.Customer.BlockCustomer(ctx, connect.NewRequest(&adminv1.BlockCustomerRequest{Id: cu.Id}))
		if err == nil {
			require.True(t, resp.Msg.Customer.Blocked)
		}
		return err
	})
	list, err = c.Customer.ListCustomers(ctx, connect.NewRequest(&adminv1.ListCustomersRequest{Blocked: proto.Bool(true)}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Customers, 1)
	require.Equal(t, cu.Id, list.Msg.Customers[0].Id)
	require.Equal(t, map[string]string{"plan": "free"}, list.Msg.Customers[0].Metadata)

	ucOneAudit(t, b, func() error {
		resp, err := c.Customer.UnblockCustomer(ctx, connect.NewRequest(&adminv1.UnblockCustomerRequest{Id: cu.Id}))
		if err == nil {
			require.False(t, resp.Msg.Customer.Blocked)
		}
		return err
	})
	ucOneAudit(t, b, func() error {
		_, err := c.Customer.DeleteCustomer(ctx, connect.NewRequest(&adminv1.DeleteCustomerRequest{Id: cu.Id}))
		return err
	})
	_, err = c.Customer.GetCustomer(ctx, connect.NewRequest(&adminv1.GetCustomerRequest{Id: cu.Id}))
	require.Equal(t, "not_found", codeOf(err))
	require.Contains(t, err.Error(), "customer "+cu.Id+" not found")

	// The external id is free again once the customer is gone.
	mkCustomer(t, c, org.Id, "Cust-42")

	audits := ucAuditRows(t, b, cu.Id)
	require.Equal(t, []string{"created", "updated", "updated", "blocked", "unblocked", "deleted"}, ucAuditActions(t, b, cu.Id))
	for _, a := range audits {
		require.Equal(t, "customer", a.ObjectType)
		require.Equal(t, org.Id, a.OrgID)
	}
	require.Contains(t, audits[0].After, `"external_id":"Cust-42"`)
	require.Contains(t, audits[1].Before, `"display_name":"Customer 42"`)
	require.Contains(t, audits[1].After, `"display_name":"C42"`)
	require.Contains(t, audits[3].After, `"blocked":true`)
	require.Empty(t, audits[5].After)
	want := []string{"customer.upserted", "customer.upserted", "customer.upserted", "customer.blocked", "customer.unblocked", "customer.deleted"}
	for i := range want {
		want[i] += " " + org.Id + " customer"
	}
	require.Equal(t, want, ucOutbox(t, b, cu.Id))
}

func TestCustomerValidation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.root()
	org := b.mkOrg("acme")
	bad := []struct {
		name  string
		req   *adminv1.CreateCustomerRequest
		field string
	}{
		{"no external id", &adminv1.CreateCustomerRequest{OrgId: org.Id}, "external_id: required"},
		{"leading space", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: " c1"}, "external_id: must not start or end with spaces"},
		{"trailing space", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "c1 "}, "external_id: must not start or end with spaces"},
		{"control character", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "c\n1"}, "external_id: "},
		{"external id too long", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: strings.Repeat("é", 201)}, "external_id: must be 1–200"},
		{"display name too long", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "c", DisplayName: strings.Repeat("x", 201)}, "display_name: "},
		{"negative budget", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "c",
			Limits: &adminv1.Limits{MaxBudget: proto.Float64(-1), BudgetDuration: "1d"}}, "limits.max_budget: "},
		{"zero tpm", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "c",
			Limits: &adminv1.Limits{TpmLimit: proto.Int64(0)}}, "limits.tpm_limit: "},
		{"per-model budget", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "c",
			Limits: &adminv1.Limits{ModelMaxBudget: map[string]float64{"gpt-4o": 5}, BudgetDuration: "1d"}}, "limits.model_max_budget: "},
		{"budget without window", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "c",
			Limits: &adminv1.Limits{SoftBudget: proto.Float64(10)}}, "limits.budget_duration: required"},
		{"zero parallel", &adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "c",
			Limits: &adminv1.Limits{MaxParallelRequests: proto.Int64(0)}}, "limits.max_parallel_requests: "},
		{"platform token without org", &adminv1.CreateCustomerRequest{ExternalId: "c"}, "org_id: required"},
	}
	n := b.auditCount()
	for _, tc := range bad {
		_, err := c.Customer.CreateCustomer(ctx, connect.NewRequest(tc.req))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.Contains(t, err.Error(), tc.field, tc.name)
	}
	require.Equal(t, n, b.auditCount(), "rejected requests write nothing")

	cu := mkCustomer(t, c, org.Id, strings.Repeat("é", 200))
	n = b.auditCount()
	badUpdates := []struct {
		name  string
		cu    *adminv1.Customer
		paths []string
		field string
	}{
		{"external id is immutable", &adminv1.Customer{Id: cu.Id, ExternalId: "new"}, []string{"external_id"}, "update_mask: external_id is immutable"},
		{"blocked not updatable", &adminv1.Customer{Id: cu.Id, Blocked: true}, []string{"blocked"}, "update_mask: "},
		{"zero tpm", &adminv1.Customer{Id: cu.Id, Limits: &adminv1.Limits{TpmLimit: proto.Int64(0)}}, []string{"limits.tpm_limit"}, "limits.tpm_limit: "},
		{"per-model rpm", &adminv1.Customer{Id: cu.Id, Limits: &adminv1.Limits{ModelRpmLimit: map[string]int64{"m": 1}}}, []string{"limits"}, "limits.model_rpm_limit: "},
		{"no mask", &adminv1.Customer{Id: cu.Id}, nil, "update_mask: required"},
		{"no id", &adminv1.Customer{}, []string{"display_name"}, "customer.id: required"},
	}
	for _, tc := range badUpdates {
		_, err := c.Customer.UpdateCustomer(ctx, connect.NewRequest(&adminv1.UpdateCustomerRequest{Customer: tc.cu, UpdateMask: &fieldmaskpb.FieldMask{Paths: tc.paths}}))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.Contains(t, err.Error(), tc.field, tc.name)
	}
	require.Equal(t, n, b.auditCount(), "rejected updates write nothing")
	got, err := c.Customer.GetCustomer(ctx, connect.NewRequest(&adminv1.GetCustomerRequest{Id: cu.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(cu, got.Msg.Customer), "rejected updates change nothing")
}

func TestCustomerDuplicateExternalID(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.root()
	org, other := b.mkOrg("acme"), b.mkOrg("other")
	mkCustomer(t, c, org.Id, "c1")
	n := b.auditCount()
	_, err := c.Customer.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "c1"}))
	require.Equal(t, "already_exists", codeOf(err))
	require.Contains(t, err.Error(), "a customer with this external_id already exists in the org")
	require.Equal(t, n, b.auditCount())
	mkCustomer(t, c, other.Id, "c1") // unique per org only
	mkCustomer(t, c, org.Id, "C1")   // external ids are case-sensitive
}

func TestCustomerCrossOrgIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	orgA, orgB := b.mkOrg("a"), b.mkOrg("b")
	ca := mkCustomer(t, b.root(), orgA.Id, "shared-id")
	cbCust := mkCustomer(t, b.root(), orgB.Id, "shared-id")
	cb := b.as(b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, orgB.Id, ""))
	n := b.auditCount()

	_, err := cb.Customer.GetCustomer(ctx, connect.NewRequest(&adminv1.GetCustomerRequest{Id: ca.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Customer.UpdateCustomer(ctx, connect.NewRequest(&adminv1.UpdateCustomerRequest{
		Customer: &adminv1.Customer{Id: ca.Id, DisplayName: "pwned"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"display_name"}},
	}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Customer.DeleteCustomer(ctx, connect.NewRequest(&adminv1.DeleteCustomerRequest{Id: ca.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Customer.BlockCustomer(ctx, connect.NewRequest(&adminv1.BlockCustomerRequest{Id: ca.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Customer.UnblockCustomer(ctx, connect.NewRequest(&adminv1.UnblockCustomerRequest{Id: ca.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = cb.Customer.ListCustomers(ctx, connect.NewRequest(&adminv1.ListCustomersRequest{OrgId: orgA.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cb.Customer.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{OrgId: orgA.Id, ExternalId: "x"}))
	require.Equal(t, "permission_denied", codeOf(err))
	require.Equal(t, n, b.auditCount(), "refused calls write nothing")

	list, err := cb.Customer.ListCustomers(ctx, connect.NewRequest(&adminv1.ListCustomersRequest{ExternalIdPrefix: "shared"}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Customers, 1, "an org token lists its own org only")
	require.Equal(t, cbCust.Id, list.Msg.Customers[0].Id)

	created, err := cb.Customer.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{ExternalId: "c2"}))
	require.NoError(t, err)
	require.Equal(t, orgB.Id, created.Msg.Customer.OrgId, "org_id defaults to the token's org")

	got, err := b.root().Customer.GetCustomer(ctx, connect.NewRequest(&adminv1.GetCustomerRequest{Id: ca.Id}))
	require.NoError(t, err)
	require.True(t, proto.Equal(ca, got.Msg.Customer), "org A's customer is untouched")
}

func TestCustomerTeamTokenDenied(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("acme")
	team := ucMkTeam(t, b, org.Id, "research")
	cu := mkCustomer(t, b.root(), org.Id, "c1")
	ct := b.as(b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_ADMIN, org.Id, team))
	n := b.auditCount()

	_, err := ct.Customer.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{ExternalId: "c2"}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Customer.GetCustomer(ctx, connect.NewRequest(&adminv1.GetCustomerRequest{Id: cu.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Customer.ListCustomers(ctx, connect.NewRequest(&adminv1.ListCustomersRequest{}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Customer.UpdateCustomer(ctx, connect.NewRequest(&adminv1.UpdateCustomerRequest{
		Customer: &adminv1.Customer{Id: cu.Id, DisplayName: "x"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"display_name"}},
	}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Customer.BlockCustomer(ctx, connect.NewRequest(&adminv1.BlockCustomerRequest{Id: cu.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Customer.UnblockCustomer(ctx, connect.NewRequest(&adminv1.UnblockCustomerRequest{Id: cu.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = ct.Customer.DeleteCustomer(ctx, connect.NewRequest(&adminv1.DeleteCustomerRequest{Id: cu.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	require.Equal(t, n, b.auditCount())
}

func TestCustomerViewerCannotMutate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("acme")
	cu := mkCustomer(t, b.root(), org.Id, "c1")
	cv := b.as(b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, org.Id, ""))
	n := b.auditCount()

	_, err := cv.Customer.GetCustomer(ctx, connect.NewRequest(&adminv1.GetCustomerRequest{Id: cu.Id}))
	require.NoError(t, err)
	list, err := cv.Customer.ListCustomers(ctx, connect.NewRequest(&adminv1.ListCustomersRequest{OrgId: org.Id}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Customers, 1)

	_, err = cv.Customer.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{ExternalId: "c2"}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cv.Customer.UpdateCustomer(ctx, connect.NewRequest(&adminv1.UpdateCustomerRequest{
		Customer: &adminv1.Customer{Id: cu.Id, DisplayName: "x"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"display_name"}},
	}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cv.Customer.BlockCustomer(ctx, connect.NewRequest(&adminv1.BlockCustomerRequest{Id: cu.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cv.Customer.UnblockCustomer(ctx, connect.NewRequest(&adminv1.UnblockCustomerRequest{Id: cu.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = cv.Customer.DeleteCustomer(ctx, connect.NewRequest(&adminv1.DeleteCustomerRequest{Id: cu.Id}))
	require.Equal(t, "permission_denied", codeOf(err))
	require.Equal(t, n, b.auditCount())

	ce := b.as(b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_EDITOR, org.Id, ""))
	_, err = ce.Customer.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{ExternalId: "c2"}))
	require.NoError(t, err, "editors may change customers")
}
