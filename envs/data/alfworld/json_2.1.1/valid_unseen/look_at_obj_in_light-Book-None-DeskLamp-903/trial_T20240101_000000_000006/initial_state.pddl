(define (problem plan_trial_T20240101_000000_000006)
(:domain alfred)
(:objects
    agent1 - agent
    Pillow_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    RemoteControl_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 - object
    Book_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    Newspaper_bar__plus_02_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 - object
    DeskLamp_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    Book_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    BookType - otype
    ButterKnifeType - otype
    DeskLampType - otype
    KnifeType - otype
    NewspaperType - otype
    PillowType - otype
    RemoteControlType - otype
    CoffeeTableType - rtype
    DrawerType - rtype
    FridgeType - rtype
    MicrowaveType - rtype
    SideTableType - rtype
    SinkBasinType - rtype
    SofaType - rtype
    Sofa_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    CoffeeTable_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    SideTable_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Drawer_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    loc_bar_0_bar_0_bar_0_bar_0 - location
    loc_bar_1_bar_1_bar_1_bar_45 - location
    loc_bar_2_bar_2_bar_1_bar_45 - location
    loc_bar_3_bar_3_bar_1_bar_45 - location
    loc_bar_4_bar_4_bar_1_bar_45 - location
)
(:init
    (receptacleType Sofa_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 SofaType)
    (receptacleAtLocation Sofa_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_1_bar_1_bar_1_bar_45)
    (objectType Pillow_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 PillowType)
    (inReceptacle Pillow_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Sofa_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Pillow_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_1_bar_1_bar_1_bar_45)
    (pickupable Pillow_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (objectType RemoteControl_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 RemoteControlType)
    (inReceptacle RemoteControl_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 Sofa_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation RemoteControl_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 loc_bar_1_bar_1_bar_1_bar_45)
    (pickupable RemoteControl_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25)
    (receptacleType CoffeeTable_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 CoffeeTableType)
    (receptacleAtLocation CoffeeTable_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_2_bar_2_bar_1_bar_45)
    (objectType Book_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 BookType)
    (inReceptacle Book_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 CoffeeTable_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Book_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_2_bar_2_bar_1_bar_45)
    (pickupable Book_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (objectType Newspaper_bar__plus_02_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 NewspaperType)
    (inReceptacle Newspaper_bar__plus_02_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 CoffeeTable_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Newspaper_bar__plus_02_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 loc_bar_2_bar_2_bar_1_bar_45)
    (pickupable Newspaper_bar__plus_02_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25)
    (receptacleType SideTable_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 SideTableType)
    (receptacleAtLocation SideTable_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_3_bar_3_bar_1_bar_45)
    (objectType DeskLamp_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 DeskLampType)
    (inReceptacle DeskLamp_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 SideTable_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation DeskLamp_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_3_bar_3_bar_1_bar_45)
    (toggleable DeskLamp_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (receptacleType Drawer_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 DrawerType)
    (receptacleAtLocation Drawer_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_4_bar_4_bar_1_bar_45)
    (openable Drawer_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectType Book_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 BookType)
    (inReceptacle Book_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Drawer_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Book_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_4_bar_4_bar_1_bar_45)
    (pickupable Book_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (canContain CoffeeTableType BookType)
    (canContain CoffeeTableType NewspaperType)
    (canContain CoffeeTableType PillowType)
    (canContain CoffeeTableType RemoteControlType)
    (canContain DrawerType BookType)
    (canContain DrawerType NewspaperType)
    (canContain DrawerType PillowType)
    (canContain DrawerType RemoteControlType)
    (canContain FridgeType BookType)
    (canContain FridgeType NewspaperType)
    (canContain FridgeType PillowType)
    (canContain FridgeType RemoteControlType)
    (canContain MicrowaveType BookType)
    (canContain MicrowaveType NewspaperType)
    (canContain MicrowaveType PillowType)
    (canContain MicrowaveType RemoteControlType)
    (canContain SideTableType BookType)
    (canContain SideTableType NewspaperType)
    (canContain SideTableType PillowType)
    (canContain SideTableType RemoteControlType)
    (canContain SinkBasinType BookType)
    (canContain SinkBasinType NewspaperType)
    (canContain SinkBasinType PillowType)
    (canContain SinkBasinType RemoteControlType)
    (canContain SofaType BookType)
    (canContain SofaType NewspaperType)
    (canContain SofaType PillowType)
    (canContain SofaType RemoteControlType)
    (atLocation agent1 loc_bar_0_bar_0_bar_0_bar_0)
)
(:goal (and (exists (?ot - object ?r - receptacle ?a - agent ?l - location) (and (objectType ?ot DeskLampType) (toggleable ?ot) (isToggled ?ot) (receptacleAtLocation ?r ?l) (atLocation ?a ?l) (inReceptacle ?ot ?r))) (exists (?o - object ?a - agent) (and (objectType ?o BookType) (holds ?a ?o)))))
)
