package admin

import (
	"context"
	"strings"
	"unicode"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// customerService implements CustomerService.
type customerService struct{ *Server }

const maxExternalIDLen = 200

// customerUpdatable lists the update_mask paths UpdateCustomer accepts
// (nested "limits.<field>" paths included through "limits").
var customerUpdatable = []string{"display_name", "limits", "metadata"}

func customerToProto(c store.Customer) (*adminv1.Customer, error) {
	l, err := limitsFromJSON(c.Limits)
	if err != nil {
		return nil, err
	}
	return &adminv1.Customer{
		Id: c.ID, OrgId: c.OrgID, ExternalId: c.ExternalID, DisplayName: c.DisplayName, Limits: l,
		Blocked: c.Blocked, Metadata: c.Metadata,
		CreateTime: timestamppb.New(c.CreatedAt), UpdateTime: timestamppb.New(c.UpdatedAt),
	}, nil
}

// validateExternalID checks the identifier clients send for a customer
// (the x-sluice-end-user header): 1–200 characters, no surrounding spaces,
// no control characters (they cannot travel in a header).
func validateExternalID(c *validator, field, s string) {
	switch {
	case s == "":
		c.add(field, "required")
	case !utf8.ValidString(s) || utf8.RuneCountInString(s) > maxExternalIDLen:
		c.add(field, "must be 1–%d characters", maxExternalIDLen)
	default:
		validateBareText(c, field, s)
	}
}

// validateBareText checks that s neither starts nor ends with spaces nor
// holds control characters (names clients send or keys carry).
func validateBareText(c *validator, field, s string) {
	switch {
	case strings.TrimSpace(s) != s:
		c.add(field, "must not start or end with spaces")
	case strings.IndexFunc(s, unicode.IsControl) >= 0:
		c.add(field, "must not contain control characters")
	}
}

// validateCustomer checks c. Fields are named as in create requests and
// update masks ("external_id", "limits.rpm_limit").
func validateCustomer(cu *adminv1.Customer) error {
	c := &validator{}
	validateExternalID(c, "external_id", cu.GetExternalId())
	validateDisplayName(c, "display_name", cu.GetDisplayName())
	validateLimits(c, "limits", cu.GetLimits(), LevelCustomer, nil)
	validateMetadata(c, cu.GetMetadata())
	return c.err()
}

func (s *customerService) CreateCustomer(ctx context.Context, req *connect.Request[adminv1.CreateCustomerRequest]) (*connect.Response[adminv1.CreateCustomerResponse], error) {
	m := req.Msg
	orgID, err := createTenant(ctx, m.GetOrgId(), "customers")
	if err != nil {
		return nil, err
	}
	want := &adminv1.Customer{ExternalId: m.GetExternalId(), DisplayName: m.GetDisplayName(), Limits: m.GetLimits(), Metadata: m.GetMetadata()}
	if err := validateCustomer(want); err != nil {
		return nil, err
	}
	cu := store.Customer{ID: ids.New(ids.Customer), OrgID: orgID, ExternalID: want.ExternalId, DisplayName: want.DisplayName,
		Limits: limitsJSON(want.Limits), Metadata: want.Metadata}
	out, err := createObject(ctx, s.store, customerObjects, &cu, func(tx *store.Tx) error { return tx.CustomerInsert(ctx, &cu) })
	return reply(&adminv1.CreateCustomerResponse{Customer: out}, err)
}

func (s *customerService) GetCustomer(ctx context.Context, req *connect.Request[adminv1.GetCustomerRequest]) (*connect.Response[adminv1.GetCustomerResponse], error) {
	id := req.Msg.GetId()
	if err := orgObjectGate(ctx, authz.Read, "customers", "id", id); err != nil {
		return nil, err
	}
	out, err := getObject(ctx, s.store, customerObjects, id)
	return reply(&adminv1.GetCustomerResponse{Customer: out}, err)
}

func (s *customerService) ListCustomers(ctx context.Context, req *connect.Request[adminv1.ListCustomersRequest]) (*connect.Response[adminv1.ListCustomersResponse], error) {
	m := req.Msg
	t, err := listTenant(ctx, m.GetOrgId(), "customers")
	if err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	q := store.CustomerQuery{ExternalIDPrefix: m.GetExternalIdPrefix(), Blocked: m.Blocked}
	rows, err := s.store.CustomerList(ctx, t, q, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListCustomersResponse{}
	resp.Customers, resp.NextPageToken, err = page(rows, limit, customerToProto, func(c store.Customer) string { return c.ID })
	return reply(resp, err)
}

func (s *customerService) UpdateCustomer(ctx context.Context, req *connect.Request[adminv1.UpdateCustomerRequest]) (*connect.Response[adminv1.UpdateCustomerResponse], error) {
	src, mask := req.Msg.GetCustomer(), req.Msg.GetUpdateMask()
	if err := customerObjects.gate(ctx, "customer.id", src.GetId()); err != nil {
		return nil, err
	}
	if err := refuseImmutable(mask, "it is the identifier clients send; create a new customer instead", "external_id"); err != nil {
		return nil, err
	}
	out, err := updateObject(ctx, s.store, customerObjects, src.GetId(), src, mask, customerUpdatable,
		func(tx *store.Tx, cur *store.Customer, _, after *adminv1.Customer) error {
			if err := validateCustomer(after); err != nil {
				return err
			}
			cur.DisplayName, cur.Limits, cur.Metadata = after.DisplayName, limitsJSON(after.Limits), after.Metadata
			return tx.CustomerUpdate(ctx, cur)
		})
	return reply(&adminv1.UpdateCustomerResponse{Customer: out}, err)
}

func (s *customerService) DeleteCustomer(ctx context.Context, req *connect.Request[adminv1.DeleteCustomerRequest]) (*connect.Response[adminv1.DeleteCustomerResponse], error) {
	return reply(&adminv1.DeleteCustomerResponse{}, deleteObject(ctx, s.store, customerObjects, req.Msg.GetId()))
}

// customerObjects is the object of Create/Update/Block/Unblock/DeleteCustomer.
var customerObjects = mutable[store.Customer, *adminv1.Customer]{
	object: events.ObjCustomer,
	gate: func(ctx context.Context, field, id string) error {
		return orgObjectGate(ctx, authz.Write, "customers", field, id)
	},
	get:          (*store.Store).CustomerGet,
	getForUpdate: (*store.Tx).CustomerGetForUpdate,
	target:       func(v store.Customer) authz.Target { return authz.OrgTarget(v.OrgID, "customer "+v.ID) },
	set: func(ctx context.Context, tx *store.Tx, cur *store.Customer, b bool) error {
		return tx.CustomerSetBlocked(ctx, cur, b)
	},
	remove: func(ctx context.Context, tx *store.Tx, cur store.Customer) (any, error) {
		return nil, tx.CustomerDelete(ctx, cur.ID)
	},
	toProto: customerToProto,
	scope:   func(c store.Customer) (string, string, string) { return c.ID, c.OrgID, "" },
}

func (s *customerService) BlockCustomer(ctx context.Context, req *connect.Request[adminv1.BlockCustomerRequest]) (*connect.Response[adminv1.BlockCustomerResponse], error) {
	cu, err := setBlocked(ctx, s.store, customerObjects, req.Msg.GetId(), true)
	return reply(&adminv1.BlockCustomerResponse{Customer: cu}, err)
}

func (s *customerService) UnblockCustomer(ctx context.Context, req *connect.Request[adminv1.UnblockCustomerRequest]) (*connect.Response[adminv1.UnblockCustomerResponse], error) {
	cu, err := setBlocked(ctx, s.store, customerObjects, req.Msg.GetId(), false)
	return reply(&adminv1.UnblockCustomerResponse{Customer: cu}, err)
}
