package main

import (
	"context"
	"flag"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

var customerColumns = []column[*adminv1.Customer]{
	{"ID", (*adminv1.Customer).GetId},
	{"ORG", (*adminv1.Customer).GetOrgId},
	{"EXTERNAL ID", (*adminv1.Customer).GetExternalId},
	{"NAME", (*adminv1.Customer).GetDisplayName},
	{"BLOCKED", func(u *adminv1.Customer) string { return yesNo(u.GetBlocked()) }},
	{"LIMITS", func(u *adminv1.Customer) string { return limitsSummary(u.GetLimits()) }},
	{"CREATED", func(u *adminv1.Customer) string { return formatTime(u.GetCreateTime()) }},
}

// customerFields registers the settable fields of an end customer. The
// external id never changes, so it is a create-only flag.
func customerFields(f *fields, u *adminv1.Customer) {
	f.String(&u.DisplayName, "display-name", "display_name", "display name")
	f.Limits(&u.Limits, limitsBasic)
	f.Metadata(&u.Metadata)
}

func customerCommand() *command {
	return group("customer", "manage end customers (x-sluice-end-user)", []*command{
		leaf("create", "[EXTERNAL_ID]", "create an end customer", runCustomerCreate),
		idCommand("get", "CUSTOMER", "show an end customer", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.customers.GetCustomer, &adminv1.GetCustomerRequest{Id: id})
			return r.GetCustomer(), err
		}),
		listCommand("", "list end customers", customerColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.Customer] {
			req := &adminv1.ListCustomersRequest{}
			fs.StringVar(&req.OrgId, "org", "", "only customers of this org")
			fs.StringVar(&req.ExternalIdPrefix, "external-id-prefix", "", "only customers whose external id starts with this")
			fs.Var(&optBool{&req.Blocked}, "blocked", "only blocked (--blocked) or unblocked (--blocked=false) customers")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.Customer, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.customers.ListCustomers, req)
				return r.GetCustomers(), r.GetNextPageToken(), err
			}
		}),
		updateCommand("customer", func() *adminv1.Customer { return &adminv1.Customer{} }, customerFields,
			func(ctx context.Context, c *clients, id string, o *adminv1.Customer, mask *fieldmaskpb.FieldMask) (*adminv1.Customer, error) {
				o.Id = id
				r, err := call(ctx, c.customers.UpdateCustomer, &adminv1.UpdateCustomerRequest{Customer: o, UpdateMask: mask})
				return r.GetCustomer(), err
			}),
		deleteCommand("customer", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			return call(ctx, c.customers.DeleteCustomer, &adminv1.DeleteCustomerRequest{Id: id})
		}),
		idCommand("block", "CUSTOMER", "block an end customer: calls on its behalf are rejected (403)", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.customers.BlockCustomer, &adminv1.BlockCustomerRequest{Id: id})
			return r.GetCustomer(), err
		}),
		idCommand("unblock", "CUSTOMER", "unblock an end customer", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.customers.UnblockCustomer, &adminv1.UnblockCustomerRequest{Id: id})
			return r.GetCustomer(), err
		}),
	}, "customers")
}

func runCustomerCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	u := &adminv1.Customer{}
	fs.StringVar(&u.OrgId, "org", "", "org of the customer (default: the token's org; required with a platform token)")
	fs.StringVar(&u.ExternalId, "external-id", "", "the identifier clients send in x-sluice-end-user (unique in the org)")
	customerFields(newFields(fs), u)
	if err := a.parseNamed(fs, c, &u.ExternalId, "external-id"); err != nil {
		return err
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.customers.CreateCustomer, &adminv1.CreateCustomerRequest{
		OrgId: u.OrgId, ExternalId: u.ExternalId, DisplayName: u.DisplayName, Limits: u.Limits, Metadata: u.Metadata,
	})
	return p.result(r.GetCustomer(), err)
}
